# Type stub of the avx512 kernel variant: the same module as _kernel_base, built from the same
# source with other compiler flags, so its signatures are _kernel_base.pyi's.  Checked
# against the compiled module by tests/test_typing.py (mypy.stubtest).
from ._kernel_base import *
