"""Drafter heads on disk: peagle's native layout (= vLLM's flat EAGLE-3 layout).

- config.py:   HeadConfig (the one way to build/read a head config), defaults, vLLM's aux-id rule, the mask
               token, "is this a parallel head", and the config's validation
- format.py:   the tensors a valid head holds (names, shapes, vocabulary maps) and validate_head
- io.py:       reading and writing head directories (config.json + model.safetensors)
- export.py:   `peagle export` (vLLM flat or speculators layout, validated before writing)
- importer.py: `peagle import` (published flat / speculators heads into the native layout)
"""
