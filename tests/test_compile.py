"""Every kernel compiles through NVRTC for each target architecture, without a GPU, with no spills."""
import re

import pytest

from cupymoe import _checks, _compile, _gpu_combine, _gpu_dispatch, _gpu_quantize, _gpu_route, _gpu_router_logits, plans
from cupymoe._contract import ACTIVATIONS, EPILOGUE_BIAS, EPILOGUE_INPUT_WEIGHT, SCALE_LAYOUTS

pytest.importorskip("cupy")

GEMM_SOURCES = tuple(dict.fromkeys(plans.SOURCES.values()))
# Each source's modules once (compiled a second time in one process, CUDA 13's NVRTC gave an empty
# log): the plain epilogue for both dtypes, and on bf16 every activation with every flag (the most
# registers an epilogue asks for) and down's bias.
EPILOGUES = [(True, plans.Epilogue(a, EPILOGUE_BIAS | EPILOGUE_INPUT_WEIGHT)) for a in range(len(ACTIVATIONS))]
EPILOGUES.append((False, plans.Epilogue(0, EPILOGUE_BIAS)))
MODULES = [
    (_gpu_dispatch.SOURCE, _gpu_dispatch.NAMES),
    (_gpu_combine.SOURCE, _gpu_combine.NAMES),
    (_gpu_route.SOURCE, _gpu_route.NAMES),
] + [
    (_gpu_router_logits.SOURCE, _gpu_router_logits.name_expressions(dtype)) for dtype in (_checks.BFLOAT16, _checks.FLOAT16)
] + [(source, plans.name_expressions(source, dtype, gated))
     for source in GEMM_SOURCES for dtype in (_checks.BFLOAT16, _checks.FLOAT16) for gated in (True, False)
     ] + [(source, plans.name_expressions(source, _checks.BFLOAT16, gated, epilogue))
          for source in GEMM_SOURCES for gated, epilogue in EPILOGUES]


def _small_shared_memory_names(dtype, fp8=plans.NOT_FP8, weight_only=False):
    """Instantiations that only GPUs with 99 KiB of shared memory per block (sm_86, sm_89) use."""
    names = []
    for tokens in (1, 64, 256, 512, 1024, 4096):
        p = plans.plan(tokens, 8, 256, 4096, 1024, 89, plans.SHARED_LIMIT_SMALLEST, fp8 != plans.NOT_FP8, weight_only)
        for cfg, gated in ((p.gate_up, True), (p.down, False)):
            name = cfg.name_expression(dtype, gated, fp8=fp8, weight_only=weight_only)
            if name not in plans.name_expressions(cfg.source, dtype, gated, fp8=fp8, weight_only=weight_only):
                names.append(name)
    return tuple(dict.fromkeys(names))


# Hopper (wgmma), and the mma.sync path of A100 and B200 (sm_100: compiled here, not yet run on one).
ARCHS = ["sm_90a", "sm_80", "sm_100"]
# Those instantiations are compiled for the GPUs that run them (sm_120: RTX 50-series, 99 KiB too).
SMALL_SHARED_MEMORY_ARCHS = ["sm_86", "sm_89", "sm_120"]
# FP8 (sm_89 and up): the quantization, and the mma.sync GEMM for each kernel layout of the weight
# scales, both dtypes, the plain and the fullest epilogue; the persistent e4m3 GEMM likewise, on sm_90a.
FP8_ARCHS = ["sm_89", "sm_90a", "sm_100", "sm_120"]
FP8_LAYOUTS = [SCALE_LAYOUTS.index("block"), SCALE_LAYOUTS.index("channel")]
MMA_SOURCE = plans.SOURCES[plans.MMA]
PERSISTENT_SOURCE = plans.SOURCES[plans.PERSISTENT]


FP8_MODULES = [(_gpu_quantize.SOURCE, _gpu_quantize.NAMES)] + [
    (MMA_SOURCE, plans.name_expressions(MMA_SOURCE, dtype, gated, plans.PLAIN, layout))
    for layout in FP8_LAYOUTS for dtype in (_checks.BFLOAT16, _checks.FLOAT16) for gated in (True, False)
] + [(MMA_SOURCE, plans.name_expressions(MMA_SOURCE, _checks.BFLOAT16, True, EPILOGUES[-2][1], layout))
     for layout in FP8_LAYOUTS]
# The persistent kernel's: bf16 for each layout, fp16's gate/up, and the fullest epilogue of each GEMM.
FP8_PERSISTENT_MODULES = [
    (PERSISTENT_SOURCE, plans.name_expressions(PERSISTENT_SOURCE, dtype, gated, epilogue, layout))
    for layout, dtype, gated, epilogue in
    [(layout, _checks.BFLOAT16, gated, plans.PLAIN) for layout in FP8_LAYOUTS for gated in (True, False)]
    + [(FP8_LAYOUTS[0], _checks.FLOAT16, True, plans.PLAIN)]
    + [(FP8_LAYOUTS[0], _checks.BFLOAT16, gated, epilogue) for gated, epilogue in EPILOGUES[-2:]]] + [
    # The trial plans' configs (each a module of its own at run time): plain and fullest epilogue, each layout.
    (PERSISTENT_SOURCE, tuple(dict.fromkeys(
        cfg.name_expression(_checks.BFLOAT16, gated, epilogue=epilogue, fp8=layout)
        for p in plans.FP8_TRIAL_PLANS for gated, epilogue in [(True, plans.PLAIN), (False, plans.PLAIN)] + EPILOGUES[-2:]
        for cfg in [p.gate_up if gated else p.down]
        if cfg != (plans.PERSISTENT_FP8.gate_up if gated else plans.PERSISTENT_FP8.down))))
    for layout in FP8_LAYOUTS]
# Weight-only FP8 (w8a16, every GPU): the mma.sync GEMM for each kernel layout, both dtypes, the plain and the
# fullest epilogue; and what the 99 KiB GPUs cut.
WEIGHT_ONLY_MODULES = [
    (MMA_SOURCE, plans.name_expressions(MMA_SOURCE, dtype, gated, epilogue, layout, weight_only=True))
    for layout, dtype, gated, epilogue in
    [(layout, dtype, gated, plans.PLAIN) for layout in FP8_LAYOUTS for dtype in (_checks.BFLOAT16, _checks.FLOAT16)
     for gated in (True, False)] + [(FP8_LAYOUTS[0], _checks.BFLOAT16, True, EPILOGUES[-2][1])]]
TARGETS = [(source, names, arch) for source, names in MODULES for arch in ARCHS] + [
    (source, names, arch) for source, names in WEIGHT_ONLY_MODULES for arch in ARCHS] + [
    (plans.SOURCES[plans.MMA], _small_shared_memory_names(dtype), arch)
    for dtype in (_checks.BFLOAT16, _checks.FLOAT16) for arch in SMALL_SHARED_MEMORY_ARCHS] + [
    (source, names, arch) for source, names in FP8_MODULES for arch in FP8_ARCHS] + [
    (source, names, "sm_90a") for source, names in FP8_PERSISTENT_MODULES] + [
    (MMA_SOURCE, names, "sm_89") for names in [_small_shared_memory_names(_checks.BFLOAT16, layout)
                                                for layout in FP8_LAYOUTS] if names] + [
    (MMA_SOURCE, _small_shared_memory_names(_checks.BFLOAT16, layout, True), "sm_86") for layout in FP8_LAYOUTS]


def _nvrtc_archs():
    """The architectures this NVRTC compiles for, as in "sm_90"; empty without NVRTC."""
    try:
        from cupy.cuda import nvrtc

        return {f"sm_{cc}" for cc in nvrtc.getSupportedArchs()}
    except Exception:
        return set()


NVRTC_ARCHS = _nvrtc_archs()
pytestmark = pytest.mark.skipif(not NVRTC_ARCHS, reason="NVRTC not installed")


@pytest.mark.parametrize("source,names,arch", TARGETS, ids=lambda v: v if isinstance(v, str) else "")
def test_compiles_without_spills(source, names, arch):
    if arch.rstrip("a") not in NVRTC_ARCHS:
        pytest.skip(f"this NVRTC does not compile for {arch} (sm_100 and sm_120 need CUDA 12.8+)")
    report = _compile.ptxas_report(source, names, arch)
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    assert len(entries) == len(names), report
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(names), report
    assert all(s == ("0", "0") for s in spills), report
    if source in plans.SOURCES.values():  # the plans leave this much room beside shared_bytes()
        assert all(int(b) <= plans.STATIC_SHARED_BYTES for b in re.findall(r"(\d+) bytes smem", report)), report


@pytest.mark.parametrize("names", [names for _, names in FP8_PERSISTENT_MODULES], ids=lambda v: v[0])
def test_fp8_persistent_wgmma_groups_stay_whole(names):
    # ptxas's C7511 (MMAs serialised: too few registers), C7519 (a group split by an injected
    # arrive) and C7520 (serialised by one): each K-tile's MMAs must stay in flight together.
    if "sm_90" not in NVRTC_ARCHS:
        pytest.skip("this NVRTC does not compile for sm_90a")
    report = _compile.ptxas_report(PERSISTENT_SOURCE, names, "sm_90a")
    assert not re.findall(r"\((C75\d\d)\)", report), report


def test_arch_options_take_sm90a_on_hopper_and_refuse_old_gpus():
    assert _compile.arch_option(90) == "-arch=sm_90a"
    assert _compile.arch_option(80) == "-arch=sm_80"
    with pytest.raises(NotImplementedError, match="8.0"):
        _compile.arch_option(75)


def test_headers_are_inlined_once():
    text = _compile.source(plans.SOURCES[plans.PERSISTENT])
    assert "#include \"" not in text
    assert text.count("struct Float16Traits<bf16>") == 1  # common.cuh, included by several headers
