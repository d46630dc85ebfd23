"""The CUDA caching allocator as a model: reserved bytes, fragmentation, OOM, snapshot replay."""
