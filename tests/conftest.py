import pytest


def _gpu_available() -> bool:
    try:
        import jax

        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if GPU:
        from jax_tk import _ffi

        if not _ffi.has_cuda_kernels():
            raise pytest.UsageError(
                "a CUDA GPU is present but jax_tk was built without its kernels: reinstall with nvcc"
            )
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
