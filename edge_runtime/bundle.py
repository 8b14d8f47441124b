"""Client bundles: everything a device needs, in one directory (ARCHITECTURE section 4).

Layout::

    BUNDLE/
      client.json            config: server address, policy (eligibility, window,
                             budget, pacing), file names and sha256 digests
      model.onnx             base model; LoRA matrices are optional inputs
      adapter.onnx_adapter   current federated adapter, ONNX Runtime adapter format
      adapter.safetensors    the same tensors for a torch trainer on the device
      ca.pem                 CA certificate for the server's TLS (if given)
      enrollment.token       enrollment token, mode 0600 (if given)
      train_program.json     ExecuTorch training program manifest (if written; it
      train.pte              names the program's digest: see ``et_program``)

``client.json`` may also name the root's Ed25519 public key (``root_public_key``, hex):
the key that certifies every node's device key (``orchard.identity``). A client run from
the bundle refuses a root that answers with another key, and can check its peers'
certificates before it has joined.

``client.json`` is written last and names the digests of the model and adapter, so a
directory without it is an unfinished bundle, and a swapped or truncated file is
caught on read. Every file is written to a temporary name and renamed into place.

This module and :func:`run_inference` import no torch: a device can run a bundle with
numpy, onnxruntime and safetensors alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from safetensors.numpy import load_file, save_file

from orchard.errors import AuthError, ConfigError, IntegrityError, OrchardError
from orchard.files import atomic_write
from orchard.typing import NDArrays

from .ort_runtime import OrtLoraModel, write_onnx_adapter
from .policy import DevicePolicy

FORMAT_VERSION = 1
CONFIG_FILE = "client.json"
MODEL_FILE = "model.onnx"
ADAPTER_ONNX_FILE = "adapter.onnx_adapter"
ADAPTER_SAFETENSORS_FILE = "adapter.safetensors"
CA_FILE = "ca.pem"
TOKEN_FILE = "enrollment.token"


class BundleError(OrchardError):
    """A bundle directory is missing, incomplete, or from an incompatible format."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _plain_file_name(name: str) -> str:
    # A bundle names files in its own directory only: a path ("../x", "/etc/passwd",
    # "sub/x") would make a device read, hash or send a file outside the bundle.
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"must be a file name in the bundle's directory, not a path: {name!r}")
    return name


FileName = Annotated[str, AfterValidator(_plain_file_name)]


class BundleFile(_Strict):
    name: FileName
    sha256: str


class ClientBundleConfig(_Strict):
    """The ``client.json`` of a bundle."""

    format_version: int = FORMAT_VERSION
    server_address: str = Field(min_length=1)
    policy: DevicePolicy = DevicePolicy()
    model: BundleFile
    input_name: str
    output_name: str
    adapter_onnx: BundleFile
    adapter_safetensors: BundleFile
    adapter_version: int = Field(ge=0)
    ca_cert: FileName | None = None
    enrollment_token: FileName | None = None
    root_public_key: str | None = Field(default=None, pattern="^[0-9a-f]{64}$")  # hex, 32 bytes
    # The ExecuTorch training program's manifest (which in turn names the program's
    # digest); None in a bundle for inference and torch training only.
    training_program: BundleFile | None = None


@dataclass(frozen=True)
class ClientBundle:
    """A bundle on disk. The token is read only when asked for."""

    path: Path
    config: ClientBundleConfig

    @property
    def model_path(self) -> Path:
        return self.path / self.config.model.name

    @property
    def adapter_path(self) -> Path:
        return self.path / self.config.adapter_onnx.name

    @property
    def adapter_safetensors_path(self) -> Path:
        return self.path / self.config.adapter_safetensors.name

    @property
    def ca_cert_path(self) -> Path | None:
        return None if self.config.ca_cert is None else self.path / self.config.ca_cert

    def adapter_arrays(self) -> NDArrays:
        return dict(load_file(str(self.adapter_safetensors_path)))

    def enrollment_token(self) -> str | None:
        """The token, refusing a file that others can read (as ssh does with keys)."""
        if self.config.enrollment_token is None:
            return None
        p = self.path / self.config.enrollment_token
        try:
            mode = p.stat().st_mode
        except FileNotFoundError:
            raise BundleError(f"{p} is named in {CONFIG_FILE} but missing") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthError(
                f"{p} is accessible by group or others (mode {stat.S_IMODE(mode):o}): run chmod 600 {p}"
            )
        return p.read_text().strip()

    @property
    def root_public_key(self) -> bytes | None:
        """The root's certificate key, if the bundle names it."""
        return None if self.config.root_public_key is None else bytes.fromhex(self.config.root_public_key)


def read_json_object(path: Path, error: type[BundleError] = BundleError) -> dict[str, Any]:
    """A bundle file's JSON object, or ``error`` naming the file: bytes that are not UTF-8,
    text that is not JSON (nested too deeply for the parser included), or JSON that is
    not an object. A device reads what it was handed; none of these is a crash."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise error(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); re-create the bundle") from None
    except json.JSONDecodeError as err:
        raise error(f"{path} is not valid JSON: {err}; re-create the bundle") from None
    except RecursionError:
        raise error(f"{path} nests its JSON too deeply to read; re-create the bundle") from None
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {type(data).__name__}, expected an object; re-create the bundle")
    return data


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    # A bundle is copied to devices: its files are world-readable unless they hold a secret
    # (the enrollment token passes 0o600), and its folder keeps the mode it was given.
    atomic_write(path, data, mode=mode, private_parent=False)


def _write_adapter_files(
    root: Path, arrays: Mapping[str, np.ndarray], version: int
) -> tuple[BundleFile, BundleFile]:
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    with tempfile.TemporaryDirectory(dir=root, prefix=".adapter.") as tmp:
        onnx_tmp = Path(tmp) / ADAPTER_ONNX_FILE
        st_tmp = Path(tmp) / ADAPTER_SAFETENSORS_FILE
        write_onnx_adapter(arrays, onnx_tmp, adapter_version=version)
        save_file(arrays, str(st_tmp), metadata={"adapter_version": str(version)})
        onnx_file = BundleFile(name=ADAPTER_ONNX_FILE, sha256=file_sha256(onnx_tmp))
        st_file = BundleFile(name=ADAPTER_SAFETENSORS_FILE, sha256=file_sha256(st_tmp))
        os.replace(onnx_tmp, root / ADAPTER_ONNX_FILE)
        os.replace(st_tmp, root / ADAPTER_SAFETENSORS_FILE)
    return onnx_file, st_file


def _write_config(root: Path, config: ClientBundleConfig) -> None:
    _write_atomic(root / CONFIG_FILE, (config.model_dump_json(indent=2) + "\n").encode())


def write_bundle(
    bundle_dir: str | os.PathLike[str],
    *,
    model_path: str | os.PathLike[str],
    adapter: Mapping[str, np.ndarray],
    adapter_version: int,
    server_address: str,
    policy: DevicePolicy | None = None,
    ca_cert: str | os.PathLike[str] | bytes | None = None,
    enrollment_token: str | None = None,
    training_program: str | None = None,
    overwrite: bool = False,
    root_public_key: bytes | None = None,
) -> ClientBundle:
    """Write a client bundle to ``bundle_dir`` and return it.

    ``model_path`` is a base model from ``onnx_export.export_lora_model``; ``adapter``
    holds its LoRA tensors by input name (checked against the model before anything
    is written). ``ca_cert`` is a PEM file path or PEM bytes. ``training_program`` is
    the file name of a training-program manifest already written into ``bundle_dir``
    (``et_export``); ``client.json`` records its digest. ``root_public_key`` is the
    root's 32-byte Ed25519 certificate key (``Store.signing_key().public_key``).
    """
    root = Path(bundle_dir)
    if (root / CONFIG_FILE).exists() and not overwrite:
        raise BundleError(f"{root} already holds a bundle: pass overwrite=True to replace it")
    model_src = Path(model_path)
    if not model_src.is_file():
        raise BundleError(f"base model {model_src} does not exist")
    base = OrtLoraModel(model_src)
    base.check_adapter(adapter)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)  # it holds a credential

    _write_atomic(root / MODEL_FILE, model_src.read_bytes())
    onnx_file, st_file = _write_adapter_files(root, adapter, adapter_version)
    ca_name = None
    if ca_cert is not None:
        pem = ca_cert if isinstance(ca_cert, bytes) else Path(ca_cert).read_bytes()
        if b"-----BEGIN CERTIFICATE-----" not in pem:
            raise BundleError("ca_cert is not a PEM certificate (no BEGIN CERTIFICATE line)")
        _write_atomic(root / CA_FILE, pem)
        ca_name = CA_FILE
    token_name = None
    if enrollment_token is not None:
        if not enrollment_token.strip():
            raise BundleError("enrollment_token is empty")
        _write_atomic(root / TOKEN_FILE, (enrollment_token.strip() + "\n").encode(), mode=0o600)
        token_name = TOKEN_FILE
    try:
        config = ClientBundleConfig(
            server_address=server_address,
            policy=policy or DevicePolicy(),
            model=BundleFile(name=MODEL_FILE, sha256=file_sha256(root / MODEL_FILE)),
            input_name=base.input_name,
            output_name=base.output_name,
            adapter_onnx=onnx_file,
            adapter_safetensors=st_file,
            adapter_version=adapter_version,
            ca_cert=ca_name,
            enrollment_token=token_name,
            root_public_key=None if root_public_key is None else root_public_key.hex(),
            training_program=None if training_program is None else BundleFile(
                name=training_program, sha256=file_sha256(root / training_program)),
        )
    except ValidationError as err:
        raise ConfigError(
            [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        ) from None
    _write_config(root, config)
    return ClientBundle(root, config)


def read_bundle(bundle_dir: str | os.PathLike[str], *, verify: bool = True) -> ClientBundle:
    """Read a bundle; with ``verify``, check the model and adapter digests."""
    root = Path(bundle_dir)
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise BundleError(
            f"{root} is not a client bundle (no {CONFIG_FILE}); write one with `orchard client bundle`"
        )
    data = read_json_object(cfg_path)
    if data.get("format_version") != FORMAT_VERSION:
        raise BundleError(
            f"{cfg_path} has format_version {data.get('format_version')!r}; this client reads {FORMAT_VERSION}"
        )
    try:
        config = ClientBundleConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(
            [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        ) from None
    bundle = ClientBundle(root, config)
    if verify:
        named = [config.model, config.adapter_onnx, config.adapter_safetensors]
        if config.training_program is not None:
            named.append(config.training_program)
        for f in named:
            p = root / f.name
            if not p.is_file():
                raise BundleError(f"{p} is named in {CONFIG_FILE} but missing")
            digest = file_sha256(p)
            if digest != f.sha256:
                raise IntegrityError(
                    f"{p} has sha256 {digest}, {CONFIG_FILE} expects {f.sha256}: re-create the bundle"
                )
    return bundle


def update_adapter(
    bundle_dir: str | os.PathLike[str], adapter: Mapping[str, np.ndarray], adapter_version: int
) -> ClientBundle:
    """Install a new federated adapter version; the base model is untouched."""
    bundle = read_bundle(bundle_dir)
    if adapter_version < bundle.config.adapter_version:
        raise BundleError(
            f"adapter version {adapter_version} is older than the installed {bundle.config.adapter_version}"
        )
    OrtLoraModel(bundle.model_path).check_adapter(adapter)
    onnx_file, st_file = _write_adapter_files(bundle.path, adapter, adapter_version)
    config = bundle.config.model_copy(
        update={
            "adapter_onnx": onnx_file,
            "adapter_safetensors": st_file,
            "adapter_version": adapter_version,
        }
    )
    _write_config(bundle.path, config)
    return ClientBundle(bundle.path, config)


def run_inference(
    bundle_dir: str | os.PathLike[str], inputs: np.ndarray | Mapping[str, np.ndarray]
) -> np.ndarray:
    """Logits of the bundle's base model with its current adapter, via ONNX Runtime only."""
    bundle = read_bundle(bundle_dir)
    model = OrtLoraModel(bundle.model_path)
    return model.run(inputs, model.load_adapter(bundle.adapter_path))


def _systemd_quote(word: str) -> str:
    # systemd unit syntax: "%" starts a specifier; quote words with spaces or quotes.
    word = word.replace("%", "%%")
    if any(c.isspace() or c in "\"'\\" for c in word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def systemd_unit(
    bundle_dir: str | os.PathLike[str],
    exe: str | os.PathLike[str] = "orchard",
    *,
    user: str | None = None,
) -> str:
    """A systemd service unit that runs ``orchard client start --bundle DIR``.

    Install it as ``/etc/systemd/system/orchard-client.service`` and
    ``systemctl enable --now orchard-client``. Training is background work, so it runs
    at low CPU and I/O priority and is restarted after failures.
    """
    bundle = Path(bundle_dir).resolve()
    exe_s = str(exe)
    if os.sep in exe_s:
        exe_s = str(Path(exe_s).resolve())
    cmd = " ".join(_systemd_quote(w) for w in (exe_s, "client", "start", "--bundle", str(bundle)))
    lines = [
        "[Unit]",
        "Description=Orchard federated learning client",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={cmd}",
        f"WorkingDirectory={_systemd_quote(str(bundle))}",
        "Restart=on-failure",
        "RestartSec=30",
        "Nice=10",
        "CPUSchedulingPolicy=batch",
        "IOSchedulingClass=idle",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ReadWritePaths={_systemd_quote(str(bundle))}",
        "PrivateTmp=yes",
    ]
    if user is not None:
        lines.append(f"User={user}")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)
