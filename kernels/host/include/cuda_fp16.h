// cuda_fp16.h for the host build: castor_host.h (force-included) provides the half and bfloat16 types
// and their conversions; the kernels include this name as they do for NVRTC.
#pragma once
