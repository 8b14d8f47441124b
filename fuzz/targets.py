"""The fuzz targets, as a table: a name, where its entry point lives, what it feeds.

A target's factory (``module:function`` in this folder) is imported under atheris's
instrumentation and returns ``one_input(data: bytes) -> None``. ``one_input`` feeds the
bytes to one parser the way the network or a device hands them to Orchard and catches
the parser's *named* refusals; anything else that escapes (an IndexError, a
RecursionError, a gRPC handler that aborts with INTERNAL) is a bug, and atheris reports
it as a crash with the input that caused it.

To add a target: write its factory next to the others and add a row here. Its seed
corpus is written by ``fuzz/make_corpus.py`` into ``fuzz/corpus/<name>/``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    factory: str  # "module:function", the module in fuzz/
    about: str


TARGETS: tuple[Target, ...] = (
    Target("codec_decode", "pure:codec_decode",
           "every codec's decode and bound, as a tier decodes an upload's per-tensor payload"),
    Target("model_delta", "pure:model_delta",
           "a downlink delta as a client applies it: safetensors blob of payloads, then the delta codec"),
    Target("safetensors_blob", "pure:safetensors_blob",
           "a model blob as the root loads an uploaded initial model (blob_to_arrays) and a client a pulled one"),
    Target("partial_sum", "pure:partial_sum",
           "an aggregator's partial-sum payload as its parent splits and reads it (decode_partial)"),
    Target("upload_part", "pure:upload_part",
           "PushUpdate's request deserializer (the data-part fast path and protobuf), held to protobuf's answer"),
    Target("secagg_message", "pure:secagg_message",
           "every SecAgg+ message decoder (decode, decode_columns held to decode's answer, from_bytes)"),
    Target("secagg_shares", "pure:secagg_shares",
           "the plaintext of an encrypted share message (unpack_shares)"),
    Target("secagg_credential", "pure:secagg_credential",
           "a peer's credential in signed SecAgg+ keys: raw key, root certificate or roster credential (identity_key)"),
    Target("bundle_client_json", "bundles:client_json",
           "a bundle's client.json as the client reads and checks it (read_bundle)"),
    Target("bundle_manifest", "bundles:training_manifest",
           "a bundle's training-program manifest (read_manifest)"),
    Target("bundle_task_json", "bundles:task_json",
           "a bundle's task.json and tokenizer.json sidecars (read_bundle_task, read_tokenizer)"),
    Target("fleet", "services:fleet",
           "each Fleet request type through FleetServicer's handlers (selector byte, credential byte, proto bytes)"),
    Target("control", "services:control",
           "each Control request type through ControlServicer's handlers (selector byte, credential byte, proto bytes)"),
)

BY_NAME = {t.name: t for t in TARGETS}
