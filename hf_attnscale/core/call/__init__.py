"""One patched attention call: from the AttentionInterface entry (dispatch) through the scale, the exit and the backend."""
