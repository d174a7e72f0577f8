"""vLLM NixlConnector's call sequence with VRAM KV caches (kv_buffer_device="cuda"): 4 layers of
K and V as torch CUDA tensors on cuda:0, scattered blocks pulled by decode (READ) and pushed by
prefill (WRITE), every byte checked on decode. Against p2phub.nixl, and against real NIXL
(nixl-cu12, UCX tcp + cuda_copy on lo) as the control, judged by its checks, not its exit code.

p2phub.nixl runs it once its backend lists "VRAM" among its memory types (the KV agent moving
GPU memory both ways); until then that case is skipped with that reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

pytest.importorskip("torch")
pytest.importorskip("numpy")

UNIT = Path(__file__).resolve().parent.parent / "unit"
sys.path.insert(0, str(UNIT))
import test_nixl_vllm_sequence as seq  # noqa: E402


def _p2phub_vram() -> str | None:
    from p2phub.nixl._api import nixl_agent, nixl_agent_config
    a = nixl_agent("probe", nixl_agent_config())
    try:
        mems = a.get_plugin_mem_types("P2PHUB")
    finally:
        a.close()
    return None if "VRAM" in mems else f"p2phub.nixl's backend moves {mems} only, not VRAM yet"


@pytest.mark.parametrize("impl", seq._impls())
def test_vllm_nixl_connector_sequence_vram(impl: str, tmp_path: Path) -> None:
    if impl == "p2phub" and (why := _p2phub_vram()):
        pytest.skip(why)
    dec, pre = seq._run(impl, tmp_path, mem="VRAM", ucx_tls="tcp,cuda_copy")
    seq.check(dec, pre)
