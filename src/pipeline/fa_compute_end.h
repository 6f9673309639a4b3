/* fa_compute_end.h -- ends a compute type's section of fa_kernels.h: its macros
 * (T, V, VL and the vector operations) are undefined, for the next type to define. */
#undef T
#undef V
#undef VL
#undef LOAD
#undef STORE
#undef BCAST
#undef MAX
#undef SELECT
#undef EXP2
#undef LOAD_TRANSPOSE
