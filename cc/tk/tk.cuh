// The tile language: one include for everything.
#pragma once
#include "common/base.cuh"
#include "types/gl.cuh"
#include "types/rt.cuh"
#include "types/rv.cuh"
#include "types/st.cuh"
#include "types/sv.cuh"
#include "ops/memory/cp_async.cuh"
#include "ops/warp/maps.cuh"
#include "ops/warp/masks.cuh"
#include "ops/warp/memory.cuh"
#include "ops/warp/mma.cuh"
#include "ops/warp/reductions.cuh"
