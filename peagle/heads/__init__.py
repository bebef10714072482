"""Drafter heads on disk: peagle's native layout (= vLLM's flat EAGLE-3 layout).

- format.py:   what a valid head is (tensor names and shapes, config rules) and its validation
- io.py:       reading and writing head directories (config.json + model.safetensors)
- export.py:   `peagle export` (vLLM flat or speculators layout, validated before writing)
- importer.py: `peagle import` (published flat / speculators heads into the native layout)
"""
