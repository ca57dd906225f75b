/* Finding the real function behind an interposed one. */
#ifndef GPUPROF_FP_RESOLVE_H
#define GPUPROF_FP_RESOLVE_H

/* dlsym(RTLD_NEXT, name), else the first loaded object whose file name contains `lib_hint` and
 * defines it (a library dlopen'ed RTLD_LOCAL is not in the global scope). Aborts with a message
 * when there is none: the application called a function that does not exist in its process. */
void *gp_real(const char *name, const char *lib_hint);

#define GP_REAL(lib_hint, name, type) \
    typedef __typeof__(type) name##_fn; \
    static name##_fn real_##name; \
    if (!real_##name) \
        real_##name = (type)gp_real(#name, lib_hint)

#define GP_EXPORT __attribute__((visibility("default")))

#endif
