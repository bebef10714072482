"""Drafter heads: the network, its config, first weights and files; on disk peagle's native layout (= vLLM's
flat EAGLE-3 layout).

- model.py:    DrafterHead, the network (EAGLE-3 and P-EAGLE share it); state_dict() is the file
- config.py:   HeadConfig (the one way to build/read a head config), defaults, vLLM's aux-id rule, the mask
               token, "is this a parallel head", and the config's validation
- format.py:   the tensors a valid head holds (names, shapes, vocabulary maps) and validate_head
- vocab.py:    the draft vocabulary (top-N target tokens) and its maps d2t / t2d
- init.py:     a head's first weights: from the target, from a trained head (--init, EAGLE-3 -> P-EAGLE), random
- io.py:       reading and writing head directories (config.json + model.safetensors)
- export.py:   what `peagle export` writes (vLLM flat or speculators layout, validated before writing)
- importer.py: what `peagle import` converts (published flat / speculators heads into the native layout)
"""
