"""The parameter server's kernel backends as pytest parameters, named in every test id.

``numpy-fallback`` always runs. ``c-kernels`` runs when the extension is built and is otherwise
shown skipped with the reason (which tests/conftest.py turns into a failure under CI=true), so a
machine without the C build never passes the C variant silently.
"""
import pytest

from fleetx.ps import kernels

C_MISSING = (None if kernels._c is not None else
             f"C kernels not built ({kernels._C_MISSING}); to fix, {kernels.FIX}")


def _c_param():
    marks = [pytest.mark.skip(reason=C_MISSING)] if C_MISSING else []
    return pytest.param("c", id="c-kernels", marks=marks)


KERNEL_BACKENDS = [pytest.param("numpy", id="numpy-fallback"), _c_param()]


@pytest.fixture(params=KERNEL_BACKENDS)
def backend(request):
    """The test runs once per backend; the active one is restored after it."""
    before = kernels.backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(before)


def require_c_kernels():
    """Skip (fail under CI=true) the calling test when the C kernels are not built."""
    if C_MISSING:
        pytest.skip(C_MISSING)
