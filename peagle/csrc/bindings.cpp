// The Python-facing sources in one translation unit (a unity build): each of them includes torch/extension.h,
// which alone took ~30 s to compile per file on a 2-core AMD EPYC (the seven files: 355 CPU-seconds of a 144 s
// build); here torch's headers are compiled once (34 s for all seven). The kernels themselves (quant_*.cpp,
// attend_*.cpp, ops.cpp, ...) include no torch header and stay separate files, built in parallel.
#include "quant.cpp"
#include "forward.cpp"
#include "argmax.cpp"
#include "draft_pass.cpp"
#include "draft_kl.cpp"
#include "train_attn.cpp"
#include "train_ops.cpp"
#include "transpose.cpp"
