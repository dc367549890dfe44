"""Keys in parts under one softmax: the engine that runs the methods which score each (query, key) pair with its
part's queries and keys rotated at positions of their own (ReRoPE, Self-Extend, Dual Chunk Attention, STRING...).

A method is an entry of the registry (`hf_attnscale.core.options.methods`), declared in parts
(`hf_attnscale.core.options.declare`): each the pairs it covers and where it rotates queries and keys. The engine
owns the rest: the call (`engine`), its prefill (`prefill`: the positions' check, flex bands or query chunks) and
its decoding step (`decode`: rows by key, keys turned by distance or from the store), the cos/sin they turn by
(`turns`), and the executions of a chunk's parts: the CPU's fused parts and the public joined formulation
(`key_parts`) and CUDA's flex (`flex_parts`).
"""
