/* libplugin_P2PHUB.so: a NIXL backend plugin whose FILE transfers run on p2phub's staged I/O
 * engine (p2phub/staged_io/_sio.c, compiled into this library: the engine hub.load_batch uses).
 *
 * Memory: DRAM and VRAM (local), FILE (a registration's devId is an open fd, or its metaInfo
 * names a path "ro|rw[,direct|sync|noatime|create]:/path" that the backend opens and closes).
 * Transfers: READ (file -> memory) and WRITE (memory -> file) with the agent itself as the
 * remote. postXfer queues the request to one worker thread per engine, which owns the I/O
 * engines (one for host memory, one per CUDA device) and their staging memory; checkXfer
 * reads the request's state. Every descriptor is checked before any byte moves, so a request
 * that names a range past the end of its file (READ) or a misaligned O_DIRECT write ends in
 * NIXL_ERR_BACKEND with nothing read or written.
 *
 * CUDA is opened with dlopen when VRAM is first registered, so the library builds and loads
 * on a host without it. NIXL takes the backend's name from the file it loaded
 * (libplugin_<NAME>.so), so the same library serves as GDS, GDS_MT or POSIX through a link
 * of that name; it then accepts that backend's documented parameters (and ignores them). */
#include "backend/backend_engine.h"
#include "backend/backend_plugin.h"

extern "C" {
#include "_sio.h"
}

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

const char *const kName = "P2PHUB";
const char *const kVersion = "0.1";
/* the longest a checkXfer waits for a request still running */
constexpr int kPollWaitUs = 200;

/* the engine's own parameters and their defaults (those of hub.load_batch) */
const nixl_b_params_t kDefaults = {
    {"depth", "128"},          /* I/Os in flight, 1..4096 */
    {"slot_bytes", "524288"},  /* staging slot size, a multiple of 4096 */
    {"slots", "256"},          /* staging slots (slot_bytes x slots of staging memory) */
    {"split_bytes", "131072"}, /* O_DIRECT reads through the staging of twice this and up go
                                  in pieces of it (0: slot-sized pieces), a multiple of 4096 */
    {"inflight_bytes", "8388608"},  /* of those reads, bytes in flight at most (0: no bound) */
};

/* parameters of the backends this library may stand in for: accepted, without effect */
const std::map<std::string, std::set<std::string>> kAliasParams = {
    {"GDS_MT", {"thread_count"}},
    {"GDS", {"batch_pool_size", "batch_limit", "max_request_size", "mode", "thread_count"}},
    {"POSIX", {"use_aio", "use_uring", "use_posix_aio", "ios_pool_size", "kernel_queue_size"}},
};

void say(const std::string &msg) { std::cerr << "p2phub nixl plugin: " << msg << std::endl; }

/* ------------------------------------------------------------------ CUDA driver, by dlopen */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;

struct {
    std::once_flag once;
    bool ok = false;
    std::string why;
    CUresult (*init)(unsigned);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*primary_release)(CUdevice);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    CUresult (*host_free)(void *);
    CUresult (*host_register)(void *, size_t, unsigned);
    CUresult (*host_unregister)(void *);
} cu;

bool cudaOpen(std::string &why) {
    std::call_once(cu.once, [] {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!h) {
            cu.why = std::string("dlopen libcuda.so.1: ") + dlerror();
            return;
        }
#define SYM(field, name) (*(void **)&cu.field = dlsym(h, name))
        bool all = SYM(init, "cuInit") && SYM(device_get, "cuDeviceGet") &&
                   SYM(primary_retain, "cuDevicePrimaryCtxRetain") &&
                   SYM(primary_release, "cuDevicePrimaryCtxRelease_v2") &&
                   SYM(ctx_set_current, "cuCtxSetCurrent") &&
                   SYM(stream_create, "cuStreamCreate") &&
                   SYM(stream_destroy, "cuStreamDestroy_v2") &&
                   SYM(host_alloc, "cuMemHostAlloc") && SYM(host_free, "cuMemFreeHost");
        /* optional: registered huge-page staging where the driver has both */
        if (!SYM(host_register, "cuMemHostRegister_v2") || !SYM(host_unregister, "cuMemHostUnregister"))
            cu.host_register = nullptr;
#undef SYM
        if (!all) {
            cu.why = "libcuda.so.1 lacks the context, stream or host-memory calls";
            return;
        }
        if (CUresult r = cu.init(0)) {
            cu.why = "cuInit failed: CUresult " + std::to_string(r);
            return;
        }
        cu.ok = true;
    });
    why = cu.why;
    return cu.ok;
}

/* ------------------------------------------------------------------ metadata and requests */

/* A FILE registration's open file: its own descriptor (path mode: the file opened here; fd
 * mode: a duplicate of the caller's fd made at registration), closed when the registration and
 * every request prepared on it let go. A request in flight so always reaches the file it was
 * prepared for, whatever becomes of the caller's fd number. `busy`: requests posted on it and
 * not finished (under the engine's m_). */
struct OpenFile {
    int fd = -1;
    bool direct = false; /* the fd is O_DIRECT */
    int busy = 0;

    ~OpenFile() {
        if (fd >= 0)
            close(fd);
    }
};

struct MemMD : nixlBackendMD {
    nixl_mem_t type;
    int device = -1;               /* VRAM: the CUDA device */
    std::shared_ptr<OpenFile> file; /* FILE */

    explicit MemMD(nixl_mem_t t) : nixlBackendMD(true), type(t) {}
};

enum ReqState { kIdle = 0, kQueued, kDone, kFailed };

struct Request : nixlBackendReqH {
    int write = 0;
    int device = -1; /* -1: host memory only */
    std::vector<int> fd;
    std::vector<unsigned long long> off, len, mem;
    std::vector<unsigned char> flags;
    std::vector<long long> result;
    std::vector<std::shared_ptr<OpenFile>> files; /* each file it uses, once */
    std::atomic<int> state{kIdle};
    std::string error;
};

constexpr size_t kHuge = 2u << 20;

/* Staging memory as the Hub makes it: private anonymous memory at a 2 MiB boundary that asks
 * for transparent huge pages (an O_DIRECT read into it is one segment per 2 MiB, and the
 * ring's fixed buffers hold fewer pages). `map`/`mapBytes`: the whole mapping, for munmap. */
void *hugeStage(size_t bytes, void *&map, size_t &mapBytes) {
    const size_t len = (bytes + kHuge - 1) / kHuge * kHuge;
    mapBytes = len + kHuge;
    map = mmap(nullptr, mapBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        map = nullptr;
        return nullptr;
    }
    const uintptr_t start = ((uintptr_t)map + kHuge - 1) / kHuge * kHuge;
    madvise((void *)start, len, MADV_HUGEPAGE); /* (plain pages where THP is off) */
    return (void *)start;
}

/* One staged I/O engine and its staging memory (pinned for a CUDA device). */
struct IoEngine {
    sio_engine *eng = nullptr;
    void *map = nullptr;     /* the staging's huge-page mapping (stage lies inside it) */
    size_t mapBytes = 0;
    bool registered = false; /* CUDA: the mapping is cuMemHostRegister'ed */
    void *stage = nullptr;
    size_t stageBytes = 0;
    CUstream stream = nullptr;
    CUcontext ctx = nullptr; /* the device's primary context, retained */
    int device = -1;
};

/* A path-mode meta (the grammar is the engine's: _sio_file.c): 1 with path and flags, 0 for
 * fd mode, -1 for a malformed one (said). */
int parseMode(const std::string &meta, std::string &path, int &flags) {
    char buf[4096], err[256] = "";
    const int rc = sio_file_meta(meta.c_str(), buf, sizeof(buf), &flags, err, sizeof(err));
    if (rc < 0)
        say(err);
    if (rc > 0)
        path = buf;
    return rc;
}

/* ------------------------------------------------------------------ the engine */

class P2phubEngine : public nixlBackendEngine {
public:
    explicit P2phubEngine(const nixlBackendInitParams *init) : nixlBackendEngine(init) {
        const nixl_b_params_t &given = getCustomParams();
        auto alias = kAliasParams.find(getType());
        for (const auto &[key, value] : given) {
            if (kDefaults.count(key))
                continue;
            if (alias != kAliasParams.end() && alias->second.count(key))
                continue;
            /* as NIXL's own plugins: a key meant for another backend is ignored, and said
             * once; P2PHUB_NIXL_STRICT_PARAMS=1 refuses it instead */
            const char *strict = getenv("P2PHUB_NIXL_STRICT_PARAMS");
            if (strict && !strcmp(strict, "1")) {
                say("backend " + getType() + ": unknown parameter '" + key +
                    "' (P2PHUB_NIXL_STRICT_PARAMS=1)");
                initErr = true;
                return;
            }
            say("backend " + getType() + ": unknown parameter '" + key + "' ignored");
        }
        if (!number(given, "depth", 1, 4096, depth_) ||
            !number(given, "slot_bytes", SIO_ALIGN, 1ULL << 30, slotBytes_) ||
            !number(given, "slots", 1, 65536, slots_) ||
            !number(given, "split_bytes", 0, 1ULL << 30, splitBytes_) ||
            !number(given, "inflight_bytes", 0, 1ULL << 40, inflightBytes_)) {
            initErr = true;
            return;
        }
        if (slotBytes_ % SIO_ALIGN || splitBytes_ % SIO_ALIGN) {
            say((slotBytes_ % SIO_ALIGN ? "slot_bytes=" + std::to_string(slotBytes_)
                                        : "split_bytes=" + std::to_string(splitBytes_)) +
                " is not a multiple of 4096");
            initErr = true;
            return;
        }
        worker_ = std::thread([this] { work(); });
    }

    ~P2phubEngine() override {
        {
            std::lock_guard<std::mutex> g(m_);
            stop_ = true;
        }
        cv_.notify_all();
        if (worker_.joinable())
            worker_.join();
    }

    bool supportsRemote() const override { return false; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return false; }
    nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG, FILE_SEG}; }

    nixl_status_t connect(const std::string &) override { return NIXL_SUCCESS; }
    nixl_status_t disconnect(const std::string &) override { return NIXL_SUCCESS; }
    nixl_status_t unloadMD(nixlBackendMD *) override { return NIXL_SUCCESS; }
    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) override {
        output = input;
        return NIXL_SUCCESS;
    }

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &type,
                              nixlBackendMD *&out) override {
        std::unique_ptr<MemMD> md(new MemMD(type));
        switch (type) {
        case DRAM_SEG:
            break;
        case VRAM_SEG: {
            std::string why;
            if (!cudaOpen(why)) {
                say("VRAM registration: " + why);
                return NIXL_ERR_NOT_SUPPORTED;
            }
            md->device = (int)mem.devId;
            prepare(md->device);
            break;
        }
        case FILE_SEG: {
            std::string path;
            int flags = 0;
            auto file = std::make_shared<OpenFile>();
            const int mode = parseMode(mem.metaInfo, path, flags);
            if (mode < 0)
                return NIXL_ERR_INVALID_PARAM;
            if (mode > 0) {
                char err[256] = "";
                file->fd = sio_file_open(path.c_str(), flags, err, sizeof(err));
                if (file->fd < 0) {
                    say(std::string("FILE registration: ") + err);
                    return NIXL_ERR_BACKEND;
                }
            } else {
                if (mem.devId > (uint64_t)INT_MAX ||
                    (file->fd = fcntl((int)mem.devId, F_DUPFD_CLOEXEC, 0)) < 0) {
                    say("FILE devId " + std::to_string(mem.devId) + " is not an open fd");
                    return NIXL_ERR_INVALID_PARAM;
                }
            }
            const int fl = fcntl(file->fd, F_GETFL);
            if (fl < 0) {
                say("FILE devId " + std::to_string(mem.devId) + ": " + strerror(errno));
                return NIXL_ERR_BACKEND;
            }
            file->direct = (fl & O_DIRECT) != 0;
            md->file = std::move(file);
            prepare(-1);
            break;
        }
        default:
            return NIXL_ERR_NOT_SUPPORTED;
        }
        out = md.release();
        return NIXL_SUCCESS;
    }

    nixl_status_t deregisterMem(nixlBackendMD *meta) override {
        MemMD *md = static_cast<MemMD *>(meta);
        if (md->file) {
            /* a request still moving this file's bytes finishes first; one only prepared
             * keeps the file open until it is released */
            std::unique_lock<std::mutex> g(m_);
            doneCv_.wait(g, [md] { return md->file->busy == 0; });
        }
        delete md;
        return NIXL_SUCCESS;
    }

    nixl_status_t queryMem(const nixl_reg_dlist_t &descs,
                           std::vector<nixl_query_resp_t> &resp) const override {
        resp.clear();
        for (int i = 0; i < descs.descCount(); i++) {
            /* as NIXL's file plugins: the meta is the file's name, as it is */
            const std::string &path = descs[i].metaInfo;
            struct stat st;
            if (!path.empty() && stat(path.c_str(), &st) == 0) {
                resp.emplace_back(nixl_b_params_t{{"size", std::to_string(st.st_size)},
                                                  {"mode", std::to_string(st.st_mode)},
                                                  {"mtime", std::to_string(st.st_mtime)}});
                continue;
            }
            resp.emplace_back(std::nullopt);
        }
        return NIXL_SUCCESS;
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t * = nullptr) const override {
        if (remote_agent != localAgent) {
            say("transfers run within agent " + localAgent + " only, not to " + remote_agent);
            return NIXL_ERR_NOT_SUPPORTED;
        }
        if (local.getType() == FILE_SEG || remote.getType() != FILE_SEG) {
            say("a transfer moves DRAM or VRAM (local) to or from FILE (remote)");
            return NIXL_ERR_NOT_SUPPORTED;
        }
        const int n = local.descCount();
        if (n != remote.descCount()) {
            say("local and remote lists differ in length");
            return NIXL_ERR_MISMATCH;
        }
        std::unique_ptr<Request> r(new Request);
        r->write = op == NIXL_WRITE;
        r->fd.resize(n);
        r->off.resize(n);
        r->len.resize(n);
        r->mem.resize(n);
        r->flags.resize(n);
        r->result.resize(n);
        for (int i = 0; i < n; i++) {
            const nixlMetaDesc &l = local[i], &f = remote[i];
            const MemMD *lm = static_cast<const MemMD *>(l.metadataP);
            const MemMD *fm = static_cast<const MemMD *>(f.metadataP);
            if (!lm || !fm || fm->type != FILE_SEG) {
                say("descriptor " + std::to_string(i) + " is not registered with this backend");
                return NIXL_ERR_INVALID_PARAM;
            }
            if (l.len != f.len) {
                say("descriptor " + std::to_string(i) + ": lengths differ");
                return NIXL_ERR_MISMATCH;
            }
            unsigned char fl = fm->file->direct ? SIO_DIRECT : 0;
            if (lm->type == VRAM_SEG) {
                if (r->device >= 0 && r->device != lm->device) {
                    say("one transfer's VRAM must be on one device");
                    return NIXL_ERR_NOT_SUPPORTED;
                }
                r->device = lm->device;
                fl |= SIO_CUDA;
            }
            r->fd[i] = fm->file->fd;
            if (std::find(r->files.begin(), r->files.end(), fm->file) == r->files.end())
                r->files.push_back(fm->file);
            r->off[i] = f.addr;
            r->len[i] = l.len;
            r->mem[i] = l.addr;
            r->flags[i] = fl;
        }
        handle = r.release();
        return NIXL_SUCCESS;
    }

    nixl_status_t postXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &,
                           const nixl_meta_dlist_t &, const std::string &,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t * = nullptr) const override {
        Request *r = static_cast<Request *>(handle);
        if (r->state.load() == kQueued)
            return NIXL_ERR_REPOST_ACTIVE;
        r->write = op == NIXL_WRITE;
        r->error.clear();
        r->state.store(kQueued);
        {
            std::lock_guard<std::mutex> g(m_);
            for (const auto &f : r->files)
                f->busy++;
            queue_.push_back(r);
        }
        cv_.notify_one();
        return NIXL_IN_PROG;
    }

    nixl_status_t checkXfer(nixlBackendReqH *handle) const override {
        const Request *r = static_cast<const Request *>(handle);
        if (r->state.load() == kQueued) {
            /* callers poll in a tight loop: wait a little here rather than take the CPU
             * from the worker that does the I/O */
            std::unique_lock<std::mutex> g(m_);
            doneCv_.wait_for(g, std::chrono::microseconds(kPollWaitUs),
                             [r] { return r->state.load() != kQueued; });
        }
        switch (r->state.load()) {
        case kQueued:
            return NIXL_IN_PROG;
        case kDone:
            return NIXL_SUCCESS;
        case kFailed:
            return NIXL_ERR_BACKEND;
        default:
            return NIXL_ERR_NOT_POSTED;
        }
    }

    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override {
        Request *r = static_cast<Request *>(handle);
        std::unique_lock<std::mutex> g(m_);
        /* the worker may still own it: wait until it let go */
        doneCv_.wait(g, [r] { return r->state.load() != kQueued; });
        g.unlock();
        delete r;
        return NIXL_SUCCESS;
    }

private:
    /* Have the worker make device's engine and staging now, in the background: a stack
     * registers its memory and files at start, and its first transfer then finds them made
     * (host: at the first FILE registration; a CUDA device: at its first VRAM one). */
    void prepare(int device) const {
        std::lock_guard<std::mutex> g(m_);
        if (!prepared_.insert(device).second)
            return;
        warm_.push_back(device);
        cv_.notify_one();
    }

    static bool number(const nixl_b_params_t &p, const char *key, unsigned long long lo,
                       unsigned long long hi, unsigned long long &out) {
        auto it = p.find(key);
        const std::string &s = it != p.end() ? it->second : kDefaults.at(key);
        char *end = nullptr;
        errno = 0;
        const unsigned long long v = strtoull(s.c_str(), &end, 10);
        if (s.empty() || *end || errno || v < lo || v > hi) {
            say(std::string(key) + "=" + s + ": want an integer in " + std::to_string(lo) +
                ".." + std::to_string(hi));
            return false;
        }
        out = v;
        return true;
    }

    /* every range inside its file (READ), every O_DIRECT write aligned: else nothing runs */
    static bool validate(Request *r) {
        std::map<int, long long> sizes;
        for (size_t i = 0; i < r->fd.size(); i++) {
            if (r->write) {
                if ((r->flags[i] & SIO_DIRECT) && (r->off[i] | r->len[i]) % SIO_ALIGN) {
                    r->error = "descriptor " + std::to_string(i) +
                               ": an O_DIRECT write needs offset and length aligned to 4096";
                    return false;
                }
                continue;
            }
            auto it = sizes.find(r->fd[i]);
            if (it == sizes.end()) {
                const long long size = sio_file_size(r->fd[i]); /* a block device's capacity */
                if (size < 0) {
                    r->error = "fd " + std::to_string(r->fd[i]) + ": " + strerror((int)-size);
                    return false;
                }
                it = sizes.emplace(r->fd[i], size).first;
            }
            if (r->off[i] + r->len[i] < r->off[i] ||
                (long long)(r->off[i] + r->len[i]) > it->second) {
                r->error = "descriptor " + std::to_string(i) + ": bytes " +
                           std::to_string(r->off[i]) + ".." + std::to_string(r->off[i] + r->len[i]) +
                           " lie past the end of fd " + std::to_string(r->fd[i]) + " (" +
                           std::to_string(it->second) + " bytes)";
                return false;
            }
        }
        return true;
    }

    IoEngine *engineFor(int device, std::string &why) {
        auto it = engines_.find(device);
        if (it != engines_.end())
            return &it->second;
        IoEngine e;
        e.device = device;
        e.stageBytes = slotBytes_ * slots_;
        char err[256] = "";
        if (device >= 0) {
            CUdevice dev;
            if (!cudaOpen(why))
                return nullptr;
            if (cu.device_get(&dev, device) || cu.primary_retain(&e.ctx, dev) ||
                cu.ctx_set_current(e.ctx)) {
                why = "CUDA device " + std::to_string(device) + ": no context";
                return nullptr;
            }
            if (cu.stream_create(&e.stream, 1 /* non-blocking */)) {
                why = "CUDA device " + std::to_string(device) + ": no stream";
                cu.primary_release(dev);
                return nullptr;
            }
            /* pinned huge pages where CUDA registers them (CU_MEMHOSTREGISTER_PORTABLE),
             * else CUDA's own pinned memory */
            e.stage = hugeStage(e.stageBytes, e.map, e.mapBytes);
            if (e.stage && cu.host_register && !cu.host_register(e.stage, e.stageBytes, 1)) {
                e.registered = true;
            } else {
                if (e.map)
                    munmap(e.map, e.mapBytes);
                e.map = nullptr;
                e.stage = nullptr;
                if (cu.host_alloc(&e.stage, e.stageBytes, 0)) {
                    why = "CUDA device " + std::to_string(device) + ": no pinned memory";
                    cu.stream_destroy(e.stream);
                    cu.primary_release(dev);
                    return nullptr;
                }
            }
        } else {
            e.stage = hugeStage(e.stageBytes, e.map, e.mapBytes);
            if (!e.stage) {
                why = std::string("staging memory: ") + strerror(errno);
                return nullptr;
            }
        }
        /* as hub.load_batch: one thread does the I/O and the copies */
        e.eng = sio_open((unsigned)depth_, slotBytes_, (unsigned)slots_, e.stage,
                         (unsigned long long)(uintptr_t)e.stream, SIO_OPT_NO_IO_THREAD, err,
                         sizeof(err));
        if (!e.eng) {
            why = std::string("staged I/O engine: ") + err;
            freeEngine(e);
            return nullptr;
        }
        sio_set_split(e.eng, splitBytes_);
        sio_set_inflight(e.eng, inflightBytes_);
        return &engines_.emplace(device, e).first->second;
    }

    static void freeEngine(IoEngine &e) {
        if (e.ctx)
            cu.ctx_set_current(e.ctx);
        if (e.eng)
            sio_close(e.eng);
        if (e.device >= 0) {
            if (e.stream)
                cu.stream_destroy(e.stream);
            if (e.registered)
                cu.host_unregister(e.stage);
            else if (e.stage && !e.map)
                cu.host_free(e.stage);
            CUdevice dev;
            if (e.ctx && !cu.device_get(&dev, e.device))
                cu.primary_release(dev);
        }
        if (e.map)
            munmap(e.map, e.mapBytes);
    }

    /* Runs request r; its final state (the worker stores it once it let go of r's files). */
    int run(Request *r) {
        if (!validate(r)) {
            say(r->error);
            return kFailed;
        }
        std::string why;
        IoEngine *e = engineFor(r->device, why);
        if (!e) {
            r->error = why;
            say(why);
            return kFailed;
        }
        if (e->ctx)
            cu.ctx_set_current(e->ctx);
        sio_stats st;
        char err[256] = "";
        memset(&st, 0, sizeof(st));
        const int rc = sio_run(e->eng, r->write, r->fd.size(), r->fd.data(), r->off.data(),
                               r->len.data(), r->mem.data(), r->flags.data(), r->result.data(),
                               &st, err, sizeof(err));
        if (rc != 0) {
            if (rc < 0) {
                r->error = std::string("staged I/O engine: ") + err;
            } else {
                for (size_t i = 0; i < r->result.size(); i++)
                    if (r->result[i] < 0) {
                        r->error = std::to_string(rc) + " descriptors failed, the first (" +
                                   std::to_string(i) + "): " + strerror((int)-r->result[i]);
                        break;
                    }
            }
            say(r->error);
            return kFailed;
        }
        return kDone;
    }

    void work() {
        std::unique_lock<std::mutex> g(m_);
        for (;;) {
            cv_.wait(g, [this] { return stop_ || !queue_.empty() || !warm_.empty(); });
            if (!warm_.empty() && !stop_) {
                const int device = warm_.front();
                warm_.pop_front();
                g.unlock();
                std::string why; /* a failure is said again by the first transfer's run */
                engineFor(device, why);
                g.lock();
                continue;
            }
            if (queue_.empty())
                break; /* stopping, nothing left */
            Request *r = queue_.front();
            queue_.pop_front();
            g.unlock();
            const int done = run(r);
            g.lock();
            for (const auto &f : r->files)
                f->busy--;
            r->state.store(done); /* under m_: a waiter may free r as soon as it sees this */
            doneCv_.notify_all();
        }
        g.unlock();
        for (auto &kv : engines_)
            freeEngine(kv.second);
        engines_.clear();
    }

    unsigned long long depth_ = 0, slotBytes_ = 0, slots_ = 0;
    unsigned long long splitBytes_ = 0, inflightBytes_ = 0;
    std::map<int, IoEngine> engines_; /* worker thread only */
    mutable std::mutex m_;
    mutable std::condition_variable cv_, doneCv_;
    mutable std::deque<Request *> queue_;
    mutable std::deque<int> warm_;    /* devices whose engines to make ahead (prepare) */
    mutable std::set<int> prepared_;
    bool stop_ = false;
    std::thread worker_;
};

} // namespace

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin *nixl_plugin_init() {
    return nixlBackendPluginCreator<P2phubEngine>::create(NIXL_PLUGIN_API_VERSION, kName,
                                                         kVersion, kDefaults,
                                                         {DRAM_SEG, VRAM_SEG, FILE_SEG});
}

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini() {}
