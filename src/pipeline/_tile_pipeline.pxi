# The tile pipeline: one work item (a block of query rows of one kv head) through the
# fused attention loop, one named stage per concern.  Included by _kernel_impl.pxi; a file per stage, included below in order.
#
#   _setup            geometry, each row's visible key interval, Q^T packed, empty state
#   for each key chunk (FA_KCHUNK keys) the rows can see, in key order:
#     for each key block (FA_BK keys) of the chunk, in key order:
#       _load_block       the block's K and V rows: in place, or widened from 16 bits
#       _scores_prefill   S^T = scale K Q^T, query rows as lanes (score micro-tiles)
#       _scores_decode    the same with keys as lanes (decode-sized tiles)
#       _finish_scores    score modifiers, then the visibility rule: the only code that
#                         reads the mask or writes -inf
#       _softmax          online-softmax step: m, l, alpha; S^T -> P^T in place
#       _pv_prefill / _pv_decode   acc = acc * alpha + P V
#     _merge_chunk (or _store_partial for flash-decoding) into the running state
#   _write_rows       out = ACC / L, lse
#
# A stage is a function of the Problem, the Tile (the work item and the key block being
# processed) and the thread's workspace, whose layout _carve alone knows.

include "_tile_state.pxi"
include "_tile_setup.pxi"
include "_tile_keys.pxi"
include "_tile_scores.pxi"
include "_tile_softmax_pv.pxi"
include "_tile_merge.pxi"
include "_tile_items.pxi"
