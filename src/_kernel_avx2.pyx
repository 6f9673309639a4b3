# cython: language_level=3
# The fused kernel built for the "avx2" instruction set; the code lives in _kernel_impl.pxi
# and setup.py sets the flags.  fastattn/_machine/isa.py picks one module at import time.
include "_kernel_impl.pxi"
