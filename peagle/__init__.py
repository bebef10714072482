"""peagle: lossless speculative decoding with EAGLE-3 and P-EAGLE drafters."""
