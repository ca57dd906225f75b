#define _GNU_SOURCE
#include "fp_resolve.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct gp_find {
    const char *name;
    const char *hint;
    void *found;
};

static int gp_find_cb(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct gp_find *f = data;
    if (f->found || !info->dlpi_name || !*info->dlpi_name || !strstr(info->dlpi_name, f->hint))
        return 0;
    void *h = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h)
        return 0;
    f->found = dlsym(h, f->name);
    dlclose(h);
    return f->found != NULL;
}

void *gp_real(const char *name, const char *lib_hint)
{
    void *p = dlsym(RTLD_NEXT, name);
    if (p)
        return p;
    struct gp_find f = {name, lib_hint, NULL};
    dl_iterate_phdr(gp_find_cb, &f);
    if (f.found)
        return f.found;
    fprintf(stderr, "gpuprof fast path: %s not found in any loaded %s library\n", name, lib_hint);
    abort();
}
