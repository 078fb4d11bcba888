// The numbers the kernels share with the host code, defined once in cupymoe/_contract.py:
// cupymoe/_compile.py passes each as -DCUPYMOE_<NAME>=<value>, and this header names them.
#pragma once

#ifndef CUPYMOE_K_TILE
#error "compile through cupymoe._compile, which passes the constants of cupymoe/_contract.py"
#endif

constexpr int BK = CUPYMOE_K_TILE;                       // K values per K-tile of the expert GEMMs
constexpr int DISPATCH_CHUNK = CUPYMOE_DISPATCH_CHUNK;   // slots per warp in dispatch_count
constexpr int EXPERT_SCAN_WARPS = CUPYMOE_DISPATCH_EXPERT_SCAN_WARPS;  // experts per block of dispatch_expert_scan
constexpr int FUSED_WARPS = CUPYMOE_DISPATCH_FUSED_WARPS;             // warps of dispatch_fused
constexpr int PRODUCER_THREADS = CUPYMOE_PRODUCER_THREADS;  // expert_gemm_ws's loading warpgroup
constexpr int BLOCK_ROWS = CUPYMOE_WGMMA_BLOCK_ROWS;     // weight rows of one m64 wgmma block
constexpr int TMA_BOX_ROWS = CUPYMOE_TMA_BOX_ROWS;       // weight rows per TMA box, stages of one K-tile
constexpr int STAGED_SLOTS = CUPYMOE_STAGED_SLOTS;       // slots per pass of expert_gemm_ws's epilogue
constexpr int GATE_UP_PAIR_ROWS = CUPYMOE_GATE_UP_PAIR_ROWS;  // FP8 gate/up stages: gate rows, then as many up rows
// Fields of a GEMM's m-tile map after its E per-expert entries (tile_map.cuh).
constexpr int TILE_MAP_TOTAL = CUPYMOE_TILE_MAP_TOTAL;
constexpr int TILE_MAP_COUNTER = CUPYMOE_TILE_MAP_COUNTER;
constexpr int TILE_MAP_PLAN = CUPYMOE_TILE_MAP_PLAN;
constexpr int TILE_MAP_EXTRA = CUPYMOE_TILE_MAP_EXTRA;
constexpr int ROUTE_MAX_GROUPS = CUPYMOE_ROUTE_MAX_GROUPS;  // route_sigmoid's expert groups, at most
// The gate/up activations (their order in cupymoe/_contract.py's ACTIVATIONS) and swigluoai's constants.
constexpr int ACT_SILU = CUPYMOE_ACT_SILU;
constexpr int ACT_GELU = CUPYMOE_ACT_GELU;
constexpr int ACT_GELU_TANH = CUPYMOE_ACT_GELU_TANH;
constexpr int ACT_SWIGLUOAI = CUPYMOE_ACT_SWIGLUOAI;
constexpr float SWIGLUOAI_LIMIT = CUPYMOE_SWIGLUOAI_LIMIT;
constexpr float SWIGLUOAI_ALPHA = CUPYMOE_SWIGLUOAI_ALPHA;
// FP8 weights (cupymoe/fp8.py): scale block and quantization group, e4m3's largest value, the amax
// floor of a group's scale, and the weight scale layouts (cupymoe/_contract.py's SCALE_LAYOUTS).
constexpr int FP8_BLOCK = CUPYMOE_FP8_BLOCK;
constexpr int QUANTIZE_THREADS = CUPYMOE_QUANTIZE_THREADS;  // quantize.cu's block
constexpr float E4M3_MAX = CUPYMOE_E4M3_MAX;
constexpr float FP8_AMAX_FLOOR = CUPYMOE_FP8_AMAX_FLOOR;
constexpr int SCALE_BLOCK = CUPYMOE_SCALE_BLOCK;
constexpr int SCALE_CHANNEL = CUPYMOE_SCALE_CHANNEL;
constexpr int SCALE_EXPERT = CUPYMOE_SCALE_EXPERT;
constexpr int NOT_FP8 = CUPYMOE_NOT_FP8;  // expert_gemm's FP8 argument for bf16/fp16 operands
// Flags of an expert GEMM's EPILOGUE: a bias per expert and column; the routing weight on the input.
constexpr int EPILOGUE_BIAS = CUPYMOE_EPILOGUE_BIAS;
constexpr int EPILOGUE_INPUT_WEIGHT = CUPYMOE_EPILOGUE_INPUT_WEIGHT;
