// Selects the one VecF32x16 for the library being built. setup.py compiles the
// same sources once per library of its ISA_LIBS table, each with exactly one of
// these macros (amx adds CPU_BACKEND_HAS_AMX to AVX512, avx_vnni adds
// CPU_BACKEND_HAS_AVX_VNNI to AVX2) and the matching -m flags.
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
