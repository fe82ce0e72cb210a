// The contract of the linear-attention ops (gated delta rule, simple GLA) with Python
// (jax_tk/linear_attention; the list's format: cc/core/core.h).
//
// The kernels are not written yet: today every call runs the chunked XLA path
// (jax_tk/linear_attention/reference.py), which already splits each sequence into chunks of CHUNK
// tokens, the size the kernels are to take, so that both paths cut a sequence (and a packed batch of
// sequences, each starting on a chunk of its own) the same way.
#pragma once

#include "core/core.h"

namespace jax_tk::linear_attention {

// clang-format off
#define JAX_TK_LINEAR_ATTENTION_CONTRACT(X)                                                                \
  X(CHUNK, 64)  /* tokens per chunk: solved together with matrix products, the state carried between */
// clang-format on
JAX_TK_DECLARE_CONTRACT(JAX_TK_LINEAR_ATTENTION_CONTRACT)
#define JAX_TK_LINEAR_ATTENTION_FORMULAS(F)

}  // namespace jax_tk::linear_attention
