"""The patch itself: options, scale laws, the attention function, model discovery, patching and loading."""
