/* p2phub's replacement for NIXL's logging header (which needs Abseil): the NIXL headers the plugin
 * compiles against name only these macros, and the plugin logs to stderr itself. */
#ifndef P2PHUB_NIXL_LOG_SHIM_H
#define P2PHUB_NIXL_LOG_SHIM_H
#include <iostream>

#define NIXL_ERROR (std::cerr << "p2phub nixl plugin: ")
#define NIXL_WARN NIXL_ERROR
#define NIXL_INFO NIXL_ERROR
#define NIXL_DEBUG NIXL_ERROR
#define NIXL_ASSERT(cond) ((void)0)
#endif
