"""Keys in parts under one softmax: the methods that score each (query, key) pair with its part's queries and keys
rotated at positions of their own (ReRoPE, leaky ReRoPE, Self-Extend, Dual Chunk Attention).

A method is a declaration (`declare`): its parts, each the pairs it covers and where it rotates queries and keys.
The engine (`engine`) owns the rest: the call's positions, chunking, decoding, and the executions, the CPU's fused
parts and the public joined formulation (`key_parts`) and CUDA's flex (`flex_parts`).
"""
