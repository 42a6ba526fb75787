// decoder_stack.cpp: the Llama decoder stack of one step as one native call (a Python class).
#pragma once

#include <torch/extension.h>

void bind_decoder_stack(pybind11::module& m);
