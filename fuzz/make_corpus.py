"""Write the seed corpus: ``fuzz/corpus/<target>/``, one small file per real message.

Every seed is made by Orchard's own writers (codec encoders, safetensors, a whole SecAgg+
session between real clients and a real server, bundle files as ``orchard client bundle``
writes them, the protos a client and an operator send), with fixed seeds, so running this
again writes the same files. Usage: ``python fuzz/make_corpus.py [TARGET ...]``.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

CORPUS = HERE / "corpus"


def codec_decode() -> Iterator[bytes]:
    from pure import CODEC_SPECS, SHAPES, SHARED_SEED

    from orchard.compression import build_codec

    rng = np.random.default_rng(0)
    for ci, spec in enumerate(CODEC_SPECS):
        codec = build_codec(spec)
        for si in (3, 5, 6):  # (7,), (3, 4), (2, 3, 5)
            x = rng.normal(size=SHAPES[si]).astype(np.float32)
            payload, _ = codec.encode(x, rng, shared_seed=SHARED_SEED)
            yield bytes([ci, si, 0]) + payload


def model_delta() -> Iterator[bytes]:
    from pure import MODEL

    from orchard import wire
    from orchard.compression import encode_model_delta

    rng = np.random.default_rng(1)
    for scale in (0.0, 0.1, 10.0):
        new = {k: v + scale * rng.normal(size=v.shape).astype(np.float32) for k, v in MODEL.items()}
        yield wire.payloads_to_blob(encode_model_delta(MODEL, new, rng, from_version=3).payloads)


def safetensors_blob() -> Iterator[bytes]:
    from pure import MODEL

    from orchard import wire

    yield wire.arrays_to_blob(MODEL)
    yield wire.arrays_to_blob({})
    yield wire.arrays_to_blob({"i": np.arange(3, dtype=np.int64), "h": np.ones((2, 2), np.float16),
                               "u": np.zeros(4, np.uint8)})
    yield wire.payloads_to_blob({"w": b"\x00\x01\x02"})


def partial_sum() -> Iterator[bytes]:
    from pure import PARTIAL_SCHEMA

    from orchard.updates import encode_partial

    payload, sizes = encode_partial({s.name: np.ones(s.shape) for s in PARTIAL_SCHEMA})
    yield bytes([len(sizes)]) + b"".join(s.to_bytes(2, "big") for s in sizes) + payload


def upload_part() -> Iterator[bytes]:
    from orchard.v1 import orchard_pb2 as pb

    yield pb.UploadPart(header=pb.UploadHeader(node_id="n", run_id="r", round=1, payload_sizes=[3, 4],
                                               codec="float32", weight=1.0, count=1)).SerializeToString()
    for n in (0, 1, 127, 128, 300):
        yield pb.UploadPart(data=bytes(range(256)) * (n // 256) + bytes(n % 256)).SerializeToString()


def secagg_messages() -> list[bytes]:
    """Every message of a whole session: 3 clients, every stage, through their bytes."""
    from orchard.secure_agg import SecAggClient, SecAggServer, SessionConfig, Stage, decode

    cfg = SessionConfig.create(["c0", "c1", "c2", "c3"], 4, neighbours=3, threshold=2, round_number=1,
                               entropy=hashlib.sha256(b"session").digest())
    server = SecAggServer(cfg)
    clients = {p: SecAggClient(p, entropy=hashlib.sha256(p.encode()).digest()) for p in cfg.participants}
    out = []
    for stage in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING):
        for node in sorted(server.pending()):
            if stage is Stage.MASKED_INPUT and node == "c3":
                continue  # a dropout: the unmasking stage asks for its mask key
            raw = server.broadcast_bytes(node)
            vec = np.arange(4, dtype=np.uint32) if stage is Stage.MASKED_INPUT else None
            reply = clients[node].respond(decode(raw), vec).to_bytes()
            server.receive(stage, node, reply)
            out += [raw, reply]
        server.close_stage()
    return out


def secagg_message() -> Iterator[bytes]:
    seen = set()
    for raw in secagg_messages():
        if raw[4] not in seen:  # one of each tag
            seen.add(raw[4])
            yield raw


def secagg_shares() -> Iterator[bytes]:
    from orchard.secure_agg import _wire

    rng = np.random.default_rng(2)
    yield _wire.pack_shares("c0", "c1", rng.bytes(_wire.MASK_KEY_SHARE_BYTES), rng.bytes(_wire.SELF_MASK_SHARE_BYTES))


def secagg_credential() -> Iterator[bytes]:
    from pure import CREDENTIAL_ROOT_SEED

    from orchard.identity import SigningKey, certify
    from orchard.secure_agg.roster import build_roster

    root = SigningKey.from_bytes(CREDENTIAL_ROOT_SEED)
    keys = {f"c{i:04d}": SigningKey.from_bytes(bytes([i + 1]) * 32).public_key for i in range(5)}
    yield keys["c0001"]
    yield certify(root, "c0001", keys["c0001"], 1)
    _, creds = build_roster(root, 1, keys)
    yield creds["c0001"]
    yield creds["c0002"]


def bundle_client_json() -> Iterator[bytes]:
    from bundles import file_digests

    from orchard.edge_runtime import bundle as b
    from orchard.edge_runtime import et_program as ep

    d = file_digests()
    files = {k: b.BundleFile(name=k, sha256=d[k]) for k in d}
    base = b.ClientBundleConfig(server_address="127.0.0.1:7000", model=files[b.MODEL_FILE], input_name="x",
                                output_name="y", adapter_onnx=files[b.ADAPTER_ONNX_FILE],
                                adapter_safetensors=files[b.ADAPTER_SAFETENSORS_FILE], adapter_version=2)
    yield base.model_dump_json(indent=2).encode()
    full = base.model_copy(update={"enrollment_token": b.TOKEN_FILE, "root_public_key": "ab" * 32,
                                   "training_program": files[ep.PROGRAM_FILE], "ca_cert": "ca.pem"})
    yield full.model_dump_json().encode()


def bundle_manifest() -> Iterator[bytes]:
    from bundles import file_digests

    from orchard.edge_runtime import et_program as ep

    decl = ep.TensorDecl
    m = ep.TrainingManifest(
        program=ep.BundleFile(name=ep.PROGRAM_FILE, sha256=file_digests()[ep.PROGRAM_FILE]), task="shakespeare",
        lora_variant="lora", lora_rank=4, micro_batch=2, seq_len=8, vocab_size=64,
        inputs=(decl(name="idx", dtype="int64", shape=(2, 8)), decl(name="targets", dtype="int64", shape=(2, 8)),
                decl(name="row_weight", dtype="float32", shape=(2,))),
        gradients_start=2, parameters_start=3, parameters=(decl(name="a.lora_A.default.weight", dtype="float32",
                                                                  shape=(4, 16)),),
        loss="sum of row-weighted token cross-entropy", executorch_version="1.5.1", base_sha256="0" * 64)
    yield m.model_dump_json(indent=2).encode()


def bundle_task_json() -> Iterator[bytes]:
    from orchard.edge_runtime.bundle_task import BundleTask
    from orchard.text import CharTokenizer

    yield b"\x00" + BundleTask("shakespeare", {"seq_len": 32}, 128).to_json().encode()
    yield b"\x00" + BundleTask("digits").to_json().encode()
    yield b"\x01" + json_bytes(CharTokenizer.from_text("To be, or not to be\n").to_dict())


def json_bytes(obj: object) -> bytes:
    import json

    return json.dumps(obj, ensure_ascii=False).encode()


SEEDS: dict[str, Callable[[], Iterator[bytes]]] = {
    "codec_decode": codec_decode,
    "model_delta": model_delta,
    "safetensors_blob": safetensors_blob,
    "partial_sum": partial_sum,
    "upload_part": upload_part,
    "secagg_message": secagg_message,
    "secagg_shares": secagg_shares,
    "secagg_credential": secagg_credential,
    "bundle_client_json": bundle_client_json,
    "bundle_manifest": bundle_manifest,
    "bundle_task_json": bundle_task_json,
}


def write(target: str, seeds: Iterator[bytes]) -> int:
    d = CORPUS / target
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    n = 0
    for data in seeds:
        (d / hashlib.sha1(data).hexdigest()).write_bytes(data)
        n += 1
    return n


def main(argv: list[str]) -> int:
    from services import SEEDS as SERVICE_SEEDS

    table = {**SEEDS, **SERVICE_SEEDS}
    for name in argv[1:] or list(table):
        print(f"{name}: {write(name, table[name]())} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
