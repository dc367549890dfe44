"""Installing a patch on a model: finding its attention modules, routing them, and undoing it all."""
