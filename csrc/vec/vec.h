// Selects the one VecF32x16 for the library being built. setup.py compiles the
// same sources three times, each with exactly one of these macros (and the
// matching -m flags), into three separate shared libraries.
#pragma once

#if defined(CPU_BACKEND_ISA_AVX512)
#include "vec_avx512.h"
#elif defined(CPU_BACKEND_ISA_AVX2)
#include "vec_avx2.h"
#elif defined(CPU_BACKEND_ISA_PORTABLE)
#include "vec_portable.h"
#else
#error "define one of CPU_BACKEND_ISA_AVX512 / CPU_BACKEND_ISA_AVX2 / CPU_BACKEND_ISA_PORTABLE"
#endif

#include "vec_math.h"
