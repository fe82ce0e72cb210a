// The linear-attention ops' FFI targets: none yet. The kernels are not written, so the op registers no
// handler (jax_tk/linear_attention runs its XLA path everywhere); cc/module.cc still lists the op, for
// its contract (linear_attention.h), and asks every op of a CUDA build for its targets.
#include "ffi/common.h"
#include "linear_attention/linear_attention.h"

namespace jax_tk {

namespace linear_attention {
FfiTargets ffi_targets();
}

FfiTargets linear_attention::ffi_targets() { return {}; }  // (declared by cc/module.cc)

}  // namespace jax_tk
