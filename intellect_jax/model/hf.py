"""Hugging Face interop: export a `Llama` as a `LlamaForCausalLM` directory, import one back.

Weights are safetensors with HF names. Our parameters are stored [in, out] (with heads split
out: q is [D, N, H]); a torch Linear weight is [out, in], so conversion is reshape + transpose.
RoPE uses HF's rotate-half layout, so q/k need no row permutation.

Both directions stream one tensor at a time (device -> host -> file, file -> host -> device), so
host memory stays within about 2x the largest single tensor, and a sharded model exports as is.
The safetensors format (8-byte header length, JSON header, raw little-endian data) is written
and read here directly, which is what makes the streaming and the precise errors possible.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from intellect_jax.model.config import ModelConfig
from intellect_jax.model.llama import Llama, abstract
from intellect_jax.model.sharding import state_shardings

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_DTYPES: dict[str, Any] = {  # safetensors dtype tag -> numpy dtype
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
_TAGS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}

Path_ = tuple[str | int, ...]
Entry = tuple[Path, int, dict[str, Any]]  # (file, data start, header entry)


class HFFormatError(ValueError):
    """An HF checkpoint directory is missing, incomplete or malformed; the message names the file/key."""


# ---- name mapping --------------------------------------------------------------------------
def weight_names(cfg: ModelConfig) -> list[tuple[str, Path_, int | None, int]]:
    """(HF name, nnx param path, layer, n_in) in HF file order.

    `layer` indexes the leading axis of a stacked (scanned) block parameter (None: not stacked);
    `n_in` is how many leading dims of one layer's param are the Linear's input (0: copied as is).
    """
    out: list[tuple[str, Path_, int | None, int]] = [("model.embed_tokens.weight", ("embed_VxD",), None, 0)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", ("layers", "attn", "wq_DxNxH"), i, 1),
            (p + "self_attn.k_proj.weight", ("layers", "attn", "wk_DxKxH"), i, 1),
            (p + "self_attn.v_proj.weight", ("layers", "attn", "wv_DxKxH"), i, 1),
            (p + "self_attn.o_proj.weight", ("layers", "attn", "wo_NxHxD"), i, 2),
            (p + "mlp.gate_proj.weight", ("layers", "mlp", "gate_DxF"), i, 1),
            (p + "mlp.up_proj.weight", ("layers", "mlp", "up_DxF"), i, 1),
            (p + "mlp.down_proj.weight", ("layers", "mlp", "down_FxD"), i, 1),
            (p + "input_layernorm.weight", ("layers", "attn_norm", "scale"), i, 0),
            (p + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), i, 0),
        ]
    out.append(("model.norm.weight", ("final_norm", "scale"), None, 0))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", ("head_DxV",), None, 1))
    return out


def _one(shape: tuple[int, ...], layer: int | None) -> tuple[int, ...]:
    """Shape of one HF tensor's part of a param: a stacked param loses its `layers` axis."""
    return shape if layer is None else shape[1:]


def _hf_shape(shape: tuple[int, ...], n_in: int) -> tuple[int, ...]:
    return shape if not n_in else (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def _to_hf(x: np.ndarray, n_in: int) -> np.ndarray:
    return x if not n_in else x.reshape(math.prod(x.shape[:n_in]), -1).T


def _from_hf(y: np.ndarray, shape: tuple[int, ...], n_in: int) -> np.ndarray:
    return y if not n_in else y.T.reshape(shape)


def _fmt(path: Path_) -> str:
    return ".".join(str(p) for p in path)


# ---- safetensors I/O -----------------------------------------------------------------------
def _write_safetensors(
    path: Path, tag: str, items: list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]
) -> None:
    """Write tensors (name, shape, fetch) one at a time; `fetch` is called only when written."""
    dt = np.dtype(_DTYPES[tag])
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, _ in items:
        n = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, fetch in items:
            a = np.ascontiguousarray(fetch(), dtype=dt)
            if a.shape != shape:
                raise ValueError(f"{name}: produced shape {a.shape}, expected {shape}")
            f.write(a.reshape(-1).view(np.uint8).data)


def _read_header(path: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """(data start, {name: entry}) after checking the header and that the data is all there."""
    if not path.is_file():
        raise HFFormatError(f"{path}: safetensors file missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFFormatError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise HFFormatError(f"{path}: truncated or corrupt safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            end = 0
            for name, e in header.items():
                if e["dtype"] not in _DTYPES:
                    raise HFFormatError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
                a, b = e["data_offsets"]
                if a < 0 or b - a != math.prod(e["shape"]) * np.dtype(_DTYPES[e["dtype"]]).itemsize:
                    raise ValueError(name)
                end = max(end, b)
        except HFFormatError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise HFFormatError(f"{path}: corrupt safetensors header ({err})") from None
    if 8 + n + end > size:
        raise HFFormatError(f"{path}: truncated safetensors file ({size} of {8 + n + end} bytes)")
    return 8 + n, header


def _read_tensor(entry: Entry) -> np.ndarray:
    path, start, e = entry
    a, b = e["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + a)
        buf = f.read(b - a)
    return np.frombuffer(buf, dtype=_DTYPES[e["dtype"]]).reshape(e["shape"])


def _tensor_index(d: Path) -> dict[str, Entry]:
    """name -> (file, data start, entry) over a single-file or sharded (index) checkpoint."""
    if (d / INDEX).is_file():
        try:
            wmap: dict[str, str] = json.loads((d / INDEX).read_text())["weight_map"]
            files = sorted(set(wmap.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise HFFormatError(f"{d / INDEX}: corrupt index ({err})") from None
    elif (d / SINGLE).is_file():
        wmap, files = {}, [SINGLE]
    else:
        raise HFFormatError(f"{d}: no {SINGLE} or {INDEX} (only safetensors is supported)")
    out: dict[str, Entry] = {}
    for fn in files:
        start, header = _read_header(d / fn)
        for name, e in header.items():
            out[name] = (d / fn, start, e)
    for name, fn in wmap.items():
        if name not in out or out[name][0].name != fn:
            raise HFFormatError(f"{d / fn}: tensor {name} listed in {INDEX} but not in the file")
    return out


# ---- config --------------------------------------------------------------------------------
def read_hf_config(hf_dir: str | Path, **overrides: Any) -> ModelConfig:
    """`ModelConfig` from `hf_dir/config.json`.

    Reads transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) configs.
    """
    d = Path(hf_dir)
    if not d.is_dir():
        raise HFFormatError(f"{d}: not a directory")
    p = d / "config.json"
    if not p.is_file():
        raise HFFormatError(f"{p}: missing")
    try:
        hf = json.loads(p.read_text())
        return ModelConfig.from_hf(hf, **overrides)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        what = f"missing key {err}" if isinstance(err, KeyError) else str(err)
        raise HFFormatError(f"{p}: {what}") from None


# ---- import --------------------------------------------------------------------------------
def load_hf_state(hf_dir: str | Path, cfg: ModelConfig, *, mesh: Mesh | None = None) -> nnx.State:
    """Parameter state for `Llama(cfg)` from an HF checkpoint, cast to `cfg.param_dtype`.

    With `mesh`, each array is placed with its `sharding.state_shardings` NamedSharding as it is
    read. Use with `nnx.update(model, state)` or `nnx.merge(graphdef, state)`.
    """
    d = Path(hf_dir)
    if not d.is_dir():
        raise HFFormatError(f"{d}: not a directory")
    index = _tensor_index(d)
    spec = weight_names(cfg)
    want = {e[0] for e in spec}
    allowed = want | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing = [e[0] for e in spec if e[0] not in index]
    extra = sorted(n for n in index if n not in allowed and not n.endswith("rotary_emb.inv_freq"))
    for names, what in ((missing, "missing tensor"), (extra, "unexpected tensor")):
        if names:
            more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
            raise HFFormatError(f"{d}: {what} {names[0]}{more}")
    _, abs_state = abstract(cfg)
    flat = dict(nnx.to_flat_state(abs_state))
    shard = dict(nnx.to_flat_state(state_shardings(abs_state, mesh))) if mesh is not None else {}
    for name, path, layer, n_in in spec:  # check every shape before reading any data
        f, _, e = index[name]
        exp = _hf_shape(_one(tuple(flat[path].shape), layer), n_in)
        if tuple(e["shape"]) != exp:
            raise HFFormatError(f"{f}: tensor {name} has shape {tuple(e['shape'])}, expected {exp}")
    if cfg.tie_embeddings and "lm_head.weight" in index:
        f = index["lm_head.weight"][0]
        head = _read_tensor(index["lm_head.weight"])
        emb = _read_tensor(index["model.embed_tokens.weight"])
        if head.shape != emb.shape or not np.array_equal(head, emb):
            raise HFFormatError(f"{f}: lm_head.weight differs from model.embed_tokens.weight "
                                "but config.json ties them (tie_word_embeddings)")
    parts: dict[Path_, list[tuple[str, int | None, int]]] = {}
    for name, path, layer, n_in in spec:
        parts.setdefault(path, []).append((name, layer, n_in))
    out = []
    for path, entries in parts.items():  # one param at a time: host memory holds one stack at most
        v = flat[path]
        x = np.empty(v.shape, v.dtype)
        for name, layer, n_in in entries:
            y = _from_hf(_read_tensor(index[name]), _one(tuple(v.shape), layer), n_in)
            x[() if layer is None else layer] = y
        arr = jax.device_put(x, shard[path].get_value()) if mesh is not None else jnp.asarray(x)
        out.append((path, v.replace(arr)))
    return nnx.from_flat_state(out)


def import_hf(
    hf_dir: str | Path, *, overrides: dict[str, Any] | None = None, mesh: Mesh | None = None
) -> tuple[Llama, ModelConfig]:
    """(model, cfg) from an HF `LlamaForCausalLM` directory (config.json + safetensors).

    `overrides` replace `ModelConfig` fields (e.g. `compute_dtype`, `remat`, `param_dtype`);
    with `mesh`, parameters are born sharded as in `sharding.init_sharded`.
    """
    cfg = read_hf_config(hf_dir, **(overrides or {}))
    state = load_hf_state(hf_dir, cfg, mesh=mesh)
    graphdef, _ = abstract(cfg)
    return nnx.merge(graphdef, state), cfg


# ---- export --------------------------------------------------------------------------------
def _key(k: Any) -> str | int:
    k = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
    return int(k) if isinstance(k, str) and k.isdigit() else k


def _param_arrays(model_or_params: Any, cfg: ModelConfig) -> dict[Path_, Any]:
    """{nnx path: array} from a module, an nnx.State, or a pure dict (int or str list keys)."""
    tree = model_or_params
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree, nnx.Param)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    got = {
        tuple(_key(k) for k in path): v.get_value() if is_var(v) else v
        for path, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_var)[0]
    }
    want = dict(nnx.to_flat_state(abstract(cfg)[1]))
    for p, v in want.items():
        if p not in got:
            raise ValueError(f"export_hf: params lack {_fmt(p)} required by cfg")
        if tuple(got[p].shape) != tuple(v.shape):
            shape = tuple(got[p].shape)
            raise ValueError(f"export_hf: {_fmt(p)} has shape {shape}, cfg needs {v.shape}")
    if extra := sorted(_fmt(p) for p in got if p not in want):
        raise ValueError(f"export_hf: params hold {extra[0]} which cfg does not have")
    return got


def _plan(sizes: list[int], limit: int) -> list[list[int]]:
    """Greedy in-order packing of tensor indices into shards of at most `limit` bytes."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    return shards


def _special_ids(tok_dir: Path) -> tuple[int | None, int | None]:
    """(bos, eos) ids named in tokenizer_config.json, looked up in tokenizer.json's added tokens."""
    added = json.loads((tok_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    ids = {t["content"]: t["id"] for t in added}
    conf_p = tok_dir / "tokenizer_config.json"
    conf = json.loads(conf_p.read_text()) if conf_p.is_file() else {}

    def tid(key: str) -> int | None:
        tok = conf.get(key)
        return ids.get(tok.get("content") if isinstance(tok, dict) else tok)

    return tid("bos_token"), tid("eos_token")


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def export_hf(
    model_or_params: nnx.Module | nnx.State | dict[str, Any],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: str = "float32",
    bos_id: int | None = None,
    eos_id: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `out_dir` as an HF `LlamaForCausalLM` checkpoint; return its path.

    The directory is written under a temp name beside `out_dir` and renamed when complete, so
    a failed export leaves nothing behind. An existing `out_dir` raises `FileExistsError` unless
    `overwrite=True`, which replaces it only after the new one is fully written.
    `model_or_params` is a `Llama`, its `nnx.state(model, nnx.Param)` or that state's pure dict.
    `dtype` is the stored weight dtype ("float32", "bfloat16" or "float16"). `tokenizer_dir`
    (tokenizer.json + tokenizer_config.json + special_tokens_map.json) is copied in; bos/eos ids
    default to the tokenizer's `bos_token`/`eos_token`.
    """
    out = Path(out_dir)
    if dtype not in _TAGS:
        raise ValueError(f"export_hf: dtype must be one of {sorted(_TAGS)}, got {dtype!r}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tok is not None:
        if not (tok / "tokenizer.json").is_file():
            raise HFFormatError(f"{tok / 'tokenizer.json'}: missing")
        tb, te = _special_ids(tok)
        bos_id = tb if bos_id is None else bos_id
        eos_id = te if eos_id is None else eos_id
    arrays = _param_arrays(model_or_params, cfg)
    tag = _TAGS[dtype]
    itemsize = np.dtype(_DTYPES[tag]).itemsize
    items = []
    for name, path, layer, n_in in weight_names(cfg):
        x = arrays[path]
        part = lambda x=x, i=layer: x if i is None else x[i]  # noqa: E731
        fetch = lambda part=part, n_in=n_in: _to_hf(np.asarray(jax.device_get(part())), n_in)  # noqa: E731
        items.append((name, _hf_shape(_one(tuple(x.shape), layer), n_in), fetch))
    sizes = [math.prod(s) * itemsize for _, s, _ in items]
    shards = _plan(sizes, max_shard_bytes) if sum(sizes) > max_shard_bytes else [list(range(len(items)))]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        hf = cfg.to_hf(bos_id=bos_id, eos_id=eos_id)
        hf.update(torch_dtype=dtype, dtype=dtype)
        _dump(tmp / "config.json", hf)
        gen = {"_from_model_config": True, "bos_token_id": bos_id, "eos_token_id": eos_id}
        _dump(tmp / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
        if len(shards) == 1:
            _write_safetensors(tmp / SINGLE, tag, items)
        else:
            wmap = {}
            for k, idx in enumerate(shards, 1):
                fn = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                _write_safetensors(tmp / fn, tag, [items[i] for i in idx])
                wmap.update({items[i][0]: fn for i in idx})
            _dump(tmp / INDEX, {"metadata": {"total_size": sum(sizes)}, "weight_map": wmap})
        if tok is not None:
            for fn in TOKENIZER_FILES:
                if (tok / fn).is_file():
                    shutil.copyfile(tok / fn, tmp / fn)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`, replacing an existing `out` only at this point."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def hf_tensors(hf_dir: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of an HF safetensors checkpoint, one at a time (inspection)."""
    for name, entry in _tensor_index(Path(hf_dir)).items():
        yield name, _read_tensor(entry)
