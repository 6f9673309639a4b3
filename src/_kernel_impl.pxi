# The fused attention kernel.  Included by one tiny .pyx per instruction set
# (_kernel_base.pyx, _kernel_avx2.pyx, _kernel_avx512.pyx), each compiled with its own
# flags; the Python front end (fastattn/_calls/api.py, through fastattn/_calls/glue.py)
# validates everything and picks the module.  This file holds the module's imports and the
# order of its parts, one concern a folder (pipeline/: the kernel; calls/: the doors into
# it):
#
#   _kernel_decls.pxd             the C micro-kernels (fa_kernels.h) and their wrappers
#   pipeline/_tile_pipeline.pxi   one work item through the stages of the fused loop, a
#                                 file a stage; the C Problem (_tile_state.pxi)
#   pipeline/_jobs.pxi            work items over fastattn's thread pool, workspaces (_run)
#   calls/_problem.pxi            filling the C Problem from the front end's description
#   pipeline/_backward.pxi        the backward pass's work items and passes (_run_backward)
#   calls/_entry_points.pxi       forward, backward, key_intervals: the validated entry points
#   calls/_probes.pxi             the kernel's vector functions for tests, build, pool facts
#   calls/_lean_gate.pxi          attention_fast: the common case recognised and run in C
#   calls/_plan.pxi               KVCachePlanBase: a serving plan's run, checked and
#                                 appended in C

from libc.string cimport memset, memcpy
from libc.stdlib cimport qsort
from cpython.mem cimport PyMem_RawMalloc, PyMem_RawFree
from libc.math cimport log, exp2, sqrt, isfinite, INFINITY
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cimport cython
cimport numpy as cnp
import numpy as np

from _kernel_decls cimport *

cnp.import_array()

include "pipeline/_tile_pipeline.pxi"
include "pipeline/_jobs.pxi"
include "calls/_problem.pxi"
include "pipeline/_backward.pxi"
include "calls/_entry_points.pxi"
include "calls/_probes.pxi"
include "calls/_lean_gate.pxi"
include "calls/_plan.pxi"
