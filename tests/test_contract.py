"""What the host code and the kernels must agree on, beyond the -D constants of cupymoe/_contract.py:
the layout of what is passed by value, and the persistent kernel's shared memory. Each check is a
static_assert of the host's number against the kernels' own, compiled by NVRTC without a GPU."""
import dataclasses

import pytest

from cupymoe import _checks, _compile, _contract, _gpu_dispatch, _gpu_experts, _tma, plans

pytest.importorskip("cupy")


def _nvrtc_available():
    try:
        from cupy.cuda import nvrtc

        return bool(nvrtc.getSupportedArchs())
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not installed")


def compile_asserts(source_name: str, asserts: list) -> None:
    """Compile ``source_name`` (headers inlined) followed by ``asserts`` for sm_90a; no kernel is
    instantiated, so only the static_asserts are evaluated."""
    from cupy.cuda import nvrtc

    text = _compile.source(source_name) + "\n" + "\n".join(asserts) + "\n"
    prog = nvrtc.createProgram(text, "contract_" + source_name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(_compile.BASE_OPTIONS) + ["-arch=sm_90a"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def persistent_configs():
    """Every persistent config the plans (and the FP8 trial plans) use on sm_90, with fp8 operands or
    not, with the pipelines cut for less shared memory too."""
    seen = []
    for fp8, chosen in [(False, p) for p in plans.PLANS] + [(True, p) for p in plans.FP8_PLANS + plans.FP8_TRIAL_PLANS]:
        for cfg, gated in ((chosen.gate_up, True), (chosen.down, False)):
            if cfg.kernel != plans.PERSISTENT:
                continue
            step = 2 if cfg.k_group == 2 else 1
            for stages in range(cfg.stages, 1, -step):
                seen.append((dataclasses.replace(cfg, stages=stages), gated, fp8))
    return list(dict.fromkeys(seen))


def test_persistent_shared_memory_is_the_kernels_layout():
    asserts = [
        f"static_assert(WsLayout<{cfg.block_m}, {cfg.stages}, {cfg.k_group}, {str(gated).lower()}, "
        f"{str(fp8).lower()}>::BYTES == {cfg.shared_bytes(gated, fp8)}, "
        f"\"shared_bytes of {cfg} (gated={gated}, fp8={fp8})\");"
        for cfg, gated, fp8 in persistent_configs()]
    assert len(asserts) >= 10
    compile_asserts(plans.SOURCES[plans.PERSISTENT], asserts)


def test_persistent_tiles_have_the_kernels_columns():
    asserts = [
        f"static_assert(TileShape<{cfg.block_m}, {str(gated).lower()}, {str(fp8).lower()}>::BN == {cfg.block_n}, "
        f"\"block_n of {cfg} (gated={gated}, fp8={fp8})\");"
        for cfg, gated, fp8 in persistent_configs()]
    compile_asserts(plans.SOURCES[plans.PERSISTENT], asserts)


def test_structs_passed_by_value_have_the_hosts_layout():
    # Members are laid out in declaration order, each at its alignment: with the host's fields in
    # that order, the same sizes and the same total, the offsets agree too.
    tile_map = _gpu_dispatch.TILE_MAP
    fields = sorted(tile_map.fields.items(), key=lambda item: item[1][1])
    assert [name for name, _ in fields] == ["block_m", "skewed_block_m", "tiles"]
    asserts = [f"static_assert(sizeof(TileMap) == {tile_map.itemsize}, \"TileMap size\");"]
    asserts += [f"static_assert(sizeof(TileMap::{name}) == {dtype.itemsize}, \"{name}\");"
                for name, (dtype, _) in fields]
    compile_asserts(_gpu_dispatch.SOURCE, asserts)
    for struct, dtype in (("EpilogueArgs", _gpu_experts.EPILOGUE_ARGS), ("Fp8Scales", _gpu_experts.FP8_SCALES)):
        asserts = [f"static_assert(sizeof({struct}) == {dtype.itemsize}, \"{struct} size\");"]
        asserts += [f"static_assert(sizeof({struct}::{name}) == {field.itemsize}, \"{name}\");"
                    for name, (field, _) in sorted(dtype.fields.items(), key=lambda item: item[1][1])]
        compile_asserts(plans.SOURCES[plans.MMA], asserts)
    compile_asserts(plans.SOURCES[plans.PERSISTENT], [
        f"static_assert(sizeof(TensorMap) == {_tma.TENSOR_MAP.itemsize}, \"TensorMap size\");",
        f"static_assert(alignof(TensorMap) == 64, \"a CUtensorMap is 64-byte aligned\");",
    ])


def test_kernels_see_the_contract_constants():
    asserts = [f"static_assert({cuda} == {value}, \"{cuda}\");" for cuda, value in (
        ("BK", _contract.K_TILE), ("DISPATCH_CHUNK", _contract.DISPATCH_CHUNK),
        ("FUSED_WARPS", _contract.DISPATCH_FUSED_WARPS), ("EXPERT_SCAN_WARPS", _contract.DISPATCH_EXPERT_SCAN_WARPS),
        ("PRODUCER_THREADS", _contract.PRODUCER_THREADS), ("BLOCK_ROWS", _contract.WGMMA_BLOCK_ROWS),
        ("TMA_BOX_ROWS", _contract.TMA_BOX_ROWS), ("STAGED_SLOTS", _contract.STAGED_SLOTS),
        ("GATE_UP_PAIR_ROWS", _contract.GATE_UP_PAIR_ROWS),
        ("TILE_MAP_PLAN", _contract.TILE_MAP_PLAN), ("TILE_MAP_EXTRA", _contract.TILE_MAP_EXTRA))]
    compile_asserts(plans.SOURCES[plans.PERSISTENT], asserts)
    assert _checks.SIZE_MULTIPLE == _contract.K_TILE


def test_a_source_compiled_without_the_contract_stops():
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(_compile.source(_gpu_dispatch.SOURCE), "no_contract", [], [])
    try:
        with pytest.raises(nvrtc.NVRTCError):
            nvrtc.compileProgram(prog, ["-std=c++17", "-arch=sm_80"])
        assert "cupymoe/_contract.py" in nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
