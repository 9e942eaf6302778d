"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import importlib.util
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


def _gpu_plugin() -> bool:  # (as intellect_jax.aot.targets looks for it; jax itself is not imported yet)
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


# XLA's CPU backend without LLVM's optimizations: the suite's programs are tiny, and on a fresh
# clone (an empty compilation cache) compiling them is most of its time: this cuts about a third
# of it (docs/results.md, "A fresh-machine CI"). Not where the [aot] extra compiles for GPUs:
# what those tests check is the code XLA's defaults make.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"] and not _gpu_plugin():
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":  # Triton kernels run in Triton's CPU interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Persistent XLA compilation cache: the many small trainers in the suite compile identical
# programs; subprocess tests inherit these variables.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_root, ".cache", "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import pytest

from helpers import coordinator  # noqa: E402,F401  (the shared socket-coordinator fixture)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenizer/data cache for the session's small trainers and the node processes of the
    multi-process tests, built here once (the bundled corpus's BPE tokenizer of the tiny model's
    vocabulary and its token shard: ~4 s of CPU), not by each of several processes that start at
    once on an empty cache (`test_launch.py` still has its nodes build their own)."""
    from helpers import TINY_DATA
    from intellect_jax.data import DataConfig, load_tokenizer, prepare_sources

    d = str(tmp_path_factory.mktemp("cache"))
    cfg = DataConfig(cache_dir=d, seq_len=TINY_DATA["seq_len"], batch_size=TINY_DATA["batch_size"],
                     bpe_vocab_size=TINY_DATA["bpe_vocab_size"])
    prepare_sources(cfg, load_tokenizer(cfg))
    return d


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`) the multi-process tests (marked `processes`,
    and so `slow`) run one after another on one worker, beside the in-process tests on the
    other: two of them at once load the two cores enough to shift their timings (a node's
    start-up outlasting a short run). Marked before `-m` selects; grouped after pytest-xdist's
    own pass, which in pytest-xdist 3.8 writes the group where pytest 9.2 no longer reads a
    node's id (`_nodeid`, now `_id`), so that no group took effect."""
    for item in items:
        if item.get_closest_marker("processes") is not None:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("processes"))
    result = yield
    if getattr(config.option, "loadgroup", False):  # (set on the workers: xdist.remote)
        from _pytest.nodes import NodeId

        for item in items:
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")})
            if names and item.nodeid.rfind("@") <= item.nodeid.rfind("]"):  # (no suffix yet: xdist's own test)
                item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")
    return result
