/*
 * fa_compute_end.h -- ends the instantiations of the tile template (fa_tile_impl.h) for one
 * compute type: undefines its macros (see fa_kernels.h), so that the next compute type
 * defines its own.  Included once after each compute type's storage types.
 */
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
