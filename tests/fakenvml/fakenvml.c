/*
 * fakenvml.c - a fake libnvidia-ml.so.1 for testing gpuguard without a GPU.
 *
 * It exports the NVML entry points that the unmodified pynvml package calls and answers them
 * from a state directory named by the environment variable FAKENVML_STATE.  The state is read
 * again at every call, so a test changes the world by rewriting files:
 *
 *   $FAKENVML_STATE/gpus.json     GPUs and failure knobs (see README.md)
 *   $FAKENVML_STATE/allocs/<f>    one key=value file per allocation of fake GPU memory
 *
 * Built twice by the Makefile: the default library models a driver >= 515; with
 * -DFAKENVML_OLD_DRIVER it models a driver < 510 (no *_v3 process lists, no memory v2).
 *
 * Written from the contract in docs/facts.md section 1 (pynvml's calls, nvml.h's layouts),
 * not from NVIDIA's header: only the ABI (symbol names, argument order, struct layouts, return
 * codes) has to match.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------ */
/* ABI                                                                                        */
/* ------------------------------------------------------------------------------------------ */

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t; /* an enum in C: int-sized, which is what ctypes assumes */

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

/* Handles point into g_devices; the struct's content is never read. */
struct nvmlDevice_st {
    unsigned char unused;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} fake_memory_v1;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} fake_memory_v2;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} fake_process_info;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} fake_pci_info;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    unsigned long long value; /* nvmlValue_t: an 8-byte union */
} fake_field_value;

_Static_assert(sizeof(fake_field_value) == 40, "nvmlFieldValue_t is 40 bytes");
_Static_assert(offsetof(fake_field_value, value) == 32, "nvmlFieldValue_t.value at 32");
_Static_assert(sizeof(fake_memory_v1) == 24, "nvmlMemory_t is 24 bytes");
_Static_assert(sizeof(fake_memory_v2) == 40, "nvmlMemory_v2_t is 40 bytes");
_Static_assert(offsetof(fake_memory_v2, total) == 8, "nvmlMemory_v2_t.total at 8");
_Static_assert(sizeof(fake_process_info) == 24, "nvmlProcessInfo_t is 24 bytes");
_Static_assert(offsetof(fake_process_info, usedGpuMemory) == 8, "usedGpuMemory at 8");
_Static_assert(sizeof(fake_pci_info) == 68, "nvmlPciInfo_t is 68 bytes");
_Static_assert(offsetof(fake_pci_info, busId) == 36, "nvmlPciInfo_t.busId at 36");

#define MEMORY_V2_VERSION 0x02000028u
#define NVML_MEMORY_ERROR_TYPE_UNCORRECTED 1
#define NVML_VOLATILE_ECC 0
#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230u
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NOT_AVAILABLE_ULL (~0ULL)
#define NO_INSTANCE 0xFFFFFFFFu
#define MIB 1048576ULL

/* Exported entry points (prototypes keep -Wmissing-prototypes quiet if someone enables it). */
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags);
API nvmlReturn_t nvmlInit_v2(void);
API nvmlReturn_t nvmlShutdown(void);
API const char *nvmlErrorString(nvmlReturn_t result);
API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length);
API nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length);
API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount);
API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);
API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device);
API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device);
API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length);
API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length);
API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index);
API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber);
API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, fake_pci_info *pci);
API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                      unsigned int *pendingMode);
API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, fake_memory_v1 *memory);
API nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *isPending);
API nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode);
API nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                           unsigned int *uncRows, unsigned int *isPending,
                                           unsigned int *failureOccurred);
API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                             unsigned long long *eccCounts);
API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                          fake_field_value *values);
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                         unsigned int *infoCount,
                                                         fake_process_info *infos);
API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device,
                                                          unsigned int *infoCount,
                                                          fake_process_info *infos);
API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            fake_process_info *infos);
#ifndef FAKENVML_OLD_DRIVER
API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, fake_memory_v2 *memory);
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                         unsigned int *infoCount,
                                                         fake_process_info *infos);
API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                          unsigned int *infoCount,
                                                          fake_process_info *infos);
API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            fake_process_info *infos);
#endif

/* ------------------------------------------------------------------------------------------ */
/* Process-wide state                                                                         */
/* ------------------------------------------------------------------------------------------ */

#define MAX_GPUS 64

static struct nvmlDevice_st g_devices[MAX_GPUS];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_init_refcount;
static long long g_races_done[MAX_GPUS]; /* process_list_race answers given, per GPU index */

/* ------------------------------------------------------------------------------------------ */
/* Small helpers                                                                              */
/* ------------------------------------------------------------------------------------------ */

static long long now_realtime_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000L;
}

static void sleep_ms(long long ms)
{
    struct timespec req = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
    struct timespec rem;
    while (nanosleep(&req, &rem) != 0 && errno == EINTR) {
        req = rem;
    }
}

/* Copy a NUL-terminated UTF-8 string into dst[size], cutting only at a character boundary. */
static void copy_utf8(char *dst, size_t size, const char *src)
{
    size_t len = strlen(src);
    if (size == 0) {
        return;
    }
    if (len >= size) {
        len = size - 1;
        while (len > 0 && ((unsigned char)src[len] & 0xC0) == 0x80) {
            len--; /* src[len] is a continuation byte: back off to the lead byte */
        }
    }
    memcpy(dst, src, len);
    dst[len] = '\0';
}

/* Read a whole (small) file into a NUL-terminated malloc'd buffer. NULL on any failure. */
static char *read_file(const char *path, size_t limit, size_t *out_len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return NULL;
    }
    size_t cap = 4096;
    size_t len = 0;
    char *buf = malloc(cap + 1);
    while (buf != NULL) {
        if (len == cap) {
            if (cap >= limit) {
                free(buf);
                buf = NULL;
                break;
            }
            cap *= 2;
            char *bigger = realloc(buf, cap + 1);
            if (bigger == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
        }
        ssize_t n = read(fd, buf + len, cap - len);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            free(buf);
            buf = NULL;
            break;
        }
        if (n == 0) {
            buf[len] = '\0';
            if (out_len != NULL) {
                *out_len = len;
            }
            break;
        }
        len += (size_t)n;
    }
    close(fd);
    return buf;
}

/* ------------------------------------------------------------------------------------------ */
/* A small JSON reader: validate the document once, then navigate it by pointer.              */
/* Supports objects, arrays, strings (all escapes, \u with surrogate pairs), numbers,         */
/* true/false/null.  Only integral numbers are used as values; others read as "absent".       */
/* ------------------------------------------------------------------------------------------ */

#define JSON_MAX_DEPTH 64

struct json {
    const char *end;
};

static const char *json_ws(const struct json *j, const char *p)
{
    while (p < j->end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) {
        p++;
    }
    return p;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

static bool read_hex4(const struct json *j, const char *p, unsigned int *out)
{
    unsigned int v = 0;
    if (j->end - p < 4) {
        return false;
    }
    for (int i = 0; i < 4; i++) {
        int h = hex_value(p[i]);
        if (h < 0) {
            return false;
        }
        v = (v << 4) | (unsigned int)h;
    }
    *out = v;
    return true;
}

static size_t utf8_encode(unsigned int cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/*
 * Scan the string starting at p (which points at the opening quote).  With out != NULL the
 * decoded UTF-8 is written to out[size] (NUL-terminated, truncated at a character boundary;
 * an escaped NUL ends it).  Returns the pointer after the closing quote, or NULL if malformed.
 */
static const char *json_string(const struct json *j, const char *p, char *out, size_t size)
{
    size_t len = 0;
    bool full = (out == NULL || size == 0);
    if (p >= j->end || *p != '"') {
        return NULL;
    }
    p++;
    while (p < j->end && *p != '"') {
        char enc[4];
        size_t n;
        unsigned char c = (unsigned char)*p;
        if (c < 0x20) {
            return NULL; /* raw control characters are not allowed in JSON strings */
        }
        if (c != '\\') {
            enc[0] = (char)c;
            n = 1;
            p++;
        } else {
            if (j->end - p < 2) {
                return NULL;
            }
            char e = p[1];
            p += 2;
            switch (e) {
            case '"': enc[0] = '"'; n = 1; break;
            case '\\': enc[0] = '\\'; n = 1; break;
            case '/': enc[0] = '/'; n = 1; break;
            case 'b': enc[0] = '\b'; n = 1; break;
            case 'f': enc[0] = '\f'; n = 1; break;
            case 'n': enc[0] = '\n'; n = 1; break;
            case 'r': enc[0] = '\r'; n = 1; break;
            case 't': enc[0] = '\t'; n = 1; break;
            case 'u': {
                unsigned int cp;
                if (!read_hex4(j, p, &cp)) {
                    return NULL;
                }
                p += 4;
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    unsigned int lo;
                    if (j->end - p >= 6 && p[0] == '\\' && p[1] == 'u' &&
                        read_hex4(j, p + 2, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
                        p += 6;
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    } else {
                        cp = 0xFFFD; /* lone high surrogate */
                    }
                } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                    cp = 0xFFFD; /* lone low surrogate */
                }
                if (cp == 0) {
                    full = true; /* an escaped NUL ends the C string; keep validating */
                    n = 0;
                } else {
                    n = utf8_encode(cp, enc);
                }
                break;
            }
            default:
                return NULL;
            }
        }
        if (!full && n > 0) {
            if (len + n < size) {
                memcpy(out + len, enc, n);
                len += n;
            } else {
                full = true; /* truncate here: whole characters only */
            }
        }
    }
    if (p >= j->end) {
        return NULL;
    }
    if (out != NULL && size > 0) {
        out[len] = '\0';
    }
    return p + 1;
}

static const char *json_number(const struct json *j, const char *p)
{
    const char *start = p;
    if (p < j->end && *p == '-') {
        p++;
    }
    if (p >= j->end || !isdigit((unsigned char)*p)) {
        return NULL;
    }
    if (*p == '0') {
        p++;
    } else {
        while (p < j->end && isdigit((unsigned char)*p)) {
            p++;
        }
    }
    if (p < j->end && *p == '.') {
        p++;
        if (p >= j->end || !isdigit((unsigned char)*p)) {
            return NULL;
        }
        while (p < j->end && isdigit((unsigned char)*p)) {
            p++;
        }
    }
    if (p < j->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < j->end && (*p == '+' || *p == '-')) {
            p++;
        }
        if (p >= j->end || !isdigit((unsigned char)*p)) {
            return NULL;
        }
        while (p < j->end && isdigit((unsigned char)*p)) {
            p++;
        }
    }
    return p > start ? p : NULL;
}

static const char *json_literal(const struct json *j, const char *p, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(j->end - p) < n || memcmp(p, word, n) != 0) {
        return NULL;
    }
    return p + n;
}

/* Skip (and validate) one value starting at p (no leading whitespace). NULL if malformed. */
static const char *json_skip(const struct json *j, const char *p, int depth)
{
    if (p >= j->end || depth > JSON_MAX_DEPTH) {
        return NULL;
    }
    switch (*p) {
    case '"':
        return json_string(j, p, NULL, 0);
    case 't':
        return json_literal(j, p, "true");
    case 'f':
        return json_literal(j, p, "false");
    case 'n':
        return json_literal(j, p, "null");
    case '[': {
        p = json_ws(j, p + 1);
        if (p < j->end && *p == ']') {
            return p + 1;
        }
        for (;;) {
            p = json_skip(j, p, depth + 1);
            if (p == NULL) {
                return NULL;
            }
            p = json_ws(j, p);
            if (p >= j->end) {
                return NULL;
            }
            if (*p == ']') {
                return p + 1;
            }
            if (*p != ',') {
                return NULL;
            }
            p = json_ws(j, p + 1);
        }
    }
    case '{': {
        p = json_ws(j, p + 1);
        if (p < j->end && *p == '}') {
            return p + 1;
        }
        for (;;) {
            p = json_string(j, p, NULL, 0);
            if (p == NULL) {
                return NULL;
            }
            p = json_ws(j, p);
            if (p >= j->end || *p != ':') {
                return NULL;
            }
            p = json_skip(j, json_ws(j, p + 1), depth + 1);
            if (p == NULL) {
                return NULL;
            }
            p = json_ws(j, p);
            if (p >= j->end) {
                return NULL;
            }
            if (*p == '}') {
                return p + 1;
            }
            if (*p != ',') {
                return NULL;
            }
            p = json_ws(j, p + 1);
        }
    }
    default:
        return json_number(j, p);
    }
}

/* In a validated object at obj, find the value of key (last one wins). NULL if absent. */
static const char *json_get(const struct json *j, const char *obj, const char *key)
{
    const char *found = NULL;
    const char *p;
    if (obj == NULL || obj >= j->end || *obj != '{') {
        return NULL;
    }
    p = json_ws(j, obj + 1);
    while (p < j->end && *p == '"') {
        char name[64];
        p = json_string(j, p, name, sizeof name);
        if (p == NULL) {
            return NULL;
        }
        p = json_ws(j, json_ws(j, p) + 1); /* past ':' */
        if (strcmp(name, key) == 0) {
            found = p;
        }
        p = json_skip(j, p, 0);
        if (p == NULL) {
            return NULL;
        }
        p = json_ws(j, p);
        if (p < j->end && *p == ',') {
            p = json_ws(j, p + 1);
        }
    }
    return found;
}

/* Iterate a validated array: first call with *cursor == NULL. Returns the next element. */
static const char *json_next(const struct json *j, const char *arr, const char **cursor)
{
    const char *p;
    if (*cursor == NULL) {
        if (arr == NULL || arr >= j->end || *arr != '[') {
            return NULL;
        }
        p = json_ws(j, arr + 1);
    } else {
        p = json_skip(j, *cursor, 0);
        if (p == NULL) {
            return NULL;
        }
        p = json_ws(j, p);
        if (p >= j->end || *p != ',') {
            return NULL;
        }
        p = json_ws(j, p + 1);
    }
    if (p >= j->end || *p == ']') {
        return NULL;
    }
    *cursor = p;
    return p;
}

/* An integral number (no fraction or exponent) that fits in long long. */
static bool json_int(const struct json *j, const char *v, long long *out)
{
    char buf[32];
    const char *end;
    if (v == NULL) {
        return false;
    }
    end = json_number(j, v);
    if (end == NULL || (size_t)(end - v) >= sizeof buf) {
        return false;
    }
    memcpy(buf, v, (size_t)(end - v));
    buf[end - v] = '\0';
    if (strpbrk(buf, ".eE") != NULL) {
        return false;
    }
    errno = 0;
    long long x = strtoll(buf, NULL, 10);
    if (errno != 0) {
        return false;
    }
    *out = x;
    return true;
}

static void get_int(const struct json *j, const char *obj, const char *key, long long *out)
{
    long long x;
    if (json_int(j, json_get(j, obj, key), &x)) {
        *out = x;
    }
}

static void get_bool(const struct json *j, const char *obj, const char *key, bool *out)
{
    const char *v = json_get(j, obj, key);
    long long x;
    if (v == NULL) {
        return;
    }
    if (json_literal(j, v, "true") != NULL) {
        *out = true;
    } else if (json_literal(j, v, "false") != NULL) {
        *out = false;
    } else if (json_int(j, v, &x)) {
        *out = x != 0;
    }
}

static void get_str(const struct json *j, const char *obj, const char *key, char *out, size_t size)
{
    const char *v = json_get(j, obj, key);
    if (v != NULL && *v == '"') {
        json_string(j, v, out, size);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* State                                                                                      */
/* ------------------------------------------------------------------------------------------ */

struct gpu_cfg {
    char name[96];
    char uuid[96];
    char pci_bus_id[32];
    long long minor;
    long long total_mib;
    long long used_mib;
    long long reserved_mib;
    long long release_delay_ms;
    long long unattributed_mib;
    long long pci_device_id;
    long long pci_subsystem_id;
    long long process_list_race;
    long long retired_pages_pending; /* -1: NOT_SUPPORTED (GPUs with row remapping) */
    long long persistence_mode;      /* -1: NOT_SUPPORTED; 0 disabled (the default); 1 enabled */
    long long remapped_rows_pending; /* -1: NOT_SUPPORTED (before Ampere) */
    long long remapped_rows_failure;
    long long ecc_volatile_uncorrected; /* -1: NOT_SUPPORTED (ECC off or absent) */
    long long recovery_action;          /* -1: the field is NOT_SUPPORTED (older driver) */
    long long mig_mode;                 /* -1: NOT_SUPPORTED (no MIG); 0 disabled; 1 enabled */
    long long mig_pending;              /* -1: as mig_mode; else the mode after the next reset */
    bool lost;
    bool no_permission;
    bool memory_not_supported;
    bool reset_required;
};

struct state {
    char dir[PATH_MAX];
    char driver_version[80];
    char block_call[128];
    long long init_error;
    long long block_ms;
    unsigned int ngpus;
    struct gpu_cfg gpus[MAX_GPUS];
};

#ifdef FAKENVML_OLD_DRIVER
#define DEFAULT_DRIVER_VERSION "470.256.02"
#else
#define DEFAULT_DRIVER_VERSION "550.54.15"
#endif

/* Bus numbers of an 8-GPU HGX board, so the default PCI ids look like a real host's. */
static const unsigned int k_default_bus[8] = {0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB};

static void gpu_defaults(struct gpu_cfg *g, unsigned int index)
{
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "NVIDIA H200");
    snprintf(g->uuid, sizeof g->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", index);
    snprintf(g->pci_bus_id, sizeof g->pci_bus_id, "00000000:%02X:00.0",
             index < 8 ? k_default_bus[index] : 0x10 + index);
    g->minor = index;
    g->total_mib = 143771;
    g->pci_device_id = 0x233510DE;    /* device 0x2335 (H200), vendor 0x10DE */
    g->pci_subsystem_id = 0x18D310DE;
    g->retired_pages_pending = -1; /* an H200 remaps rows instead of retiring pages */
    g->mig_pending = -1;
}

/* Load gpus.json from $FAKENVML_STATE. NULL when unset, unreadable or malformed. */
static struct state *load_state(void)
{
    const char *dir = getenv("FAKENVML_STATE");
    char path[PATH_MAX + 16];
    size_t len = 0;
    struct json j;
    struct state *st;
    char *text;
    const char *top;
    const char *end;

    if (dir == NULL || dir[0] == '\0' || strlen(dir) >= PATH_MAX) {
        return NULL;
    }
    snprintf(path, sizeof path, "%s/gpus.json", dir);
    text = read_file(path, 1 << 20, &len);
    if (text == NULL) {
        return NULL;
    }
    j.end = text + len;
    top = json_ws(&j, text);
    end = json_skip(&j, top, 0);
    if (end == NULL || json_ws(&j, end) != j.end || *top != '{') {
        free(text);
        return NULL;
    }
    st = calloc(1, sizeof *st);
    if (st == NULL) {
        free(text);
        return NULL;
    }
    snprintf(st->dir, sizeof st->dir, "%s", dir);
    snprintf(st->driver_version, sizeof st->driver_version, "%s", DEFAULT_DRIVER_VERSION);
    get_str(&j, top, "driver_version", st->driver_version, sizeof st->driver_version);
    get_str(&j, top, "block_call", st->block_call, sizeof st->block_call);
    get_int(&j, top, "init_error", &st->init_error);
    get_int(&j, top, "block_ms", &st->block_ms);

    const char *gpus = json_get(&j, top, "gpus");
    const char *cursor = NULL;
    const char *item;
    while (st->ngpus < MAX_GPUS && (item = json_next(&j, gpus, &cursor)) != NULL) {
        struct gpu_cfg *g = &st->gpus[st->ngpus];
        gpu_defaults(g, st->ngpus);
        st->ngpus++;
        if (*item != '{') {
            continue; /* not an object: a GPU with every default */
        }
        get_str(&j, item, "name", g->name, sizeof g->name);
        get_str(&j, item, "uuid", g->uuid, sizeof g->uuid);
        get_str(&j, item, "pci_bus_id", g->pci_bus_id, sizeof g->pci_bus_id);
        get_int(&j, item, "minor", &g->minor);
        get_int(&j, item, "total_mib", &g->total_mib);
        get_int(&j, item, "used_mib", &g->used_mib);
        get_int(&j, item, "reserved_mib", &g->reserved_mib);
        get_int(&j, item, "release_delay_ms", &g->release_delay_ms);
        get_int(&j, item, "unattributed_mib", &g->unattributed_mib);
        get_int(&j, item, "pci_device_id", &g->pci_device_id);
        get_int(&j, item, "pci_subsystem_id", &g->pci_subsystem_id);
        get_int(&j, item, "process_list_race", &g->process_list_race);
        get_bool(&j, item, "lost", &g->lost);
        get_bool(&j, item, "no_permission", &g->no_permission);
        get_bool(&j, item, "memory_not_supported", &g->memory_not_supported);
        get_bool(&j, item, "reset_required", &g->reset_required);
        get_int(&j, item, "retired_pages_pending", &g->retired_pages_pending);
        get_int(&j, item, "persistence_mode", &g->persistence_mode);
        get_int(&j, item, "remapped_rows_pending", &g->remapped_rows_pending);
        get_int(&j, item, "remapped_rows_failure", &g->remapped_rows_failure);
        get_int(&j, item, "ecc_volatile_uncorrected", &g->ecc_volatile_uncorrected);
        get_int(&j, item, "recovery_action", &g->recovery_action);
        get_int(&j, item, "mig_mode", &g->mig_mode);
        get_int(&j, item, "mig_pending", &g->mig_pending);
        if (g->minor < 0 || g->minor > 0xFFFF) {
            g->minor = st->ngpus - 1;
        }
    }
    free(text);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Allocations                                                                                */
/* ------------------------------------------------------------------------------------------ */

enum kind { KIND_COMPUTE, KIND_GRAPHICS, KIND_MPS };

struct alloc {
    unsigned int pid;
    long long minor;
    long long mib;
    enum kind kind;
    bool report_usage;
    bool released;
    long long released_at_ms;
};

/* A decimal integer: optional '-', then digits only (no spaces, no '+'). */
static bool parse_ll(const char *s, long long *out)
{
    char *end;
    if (!isdigit((unsigned char)s[s[0] == '-'])) {
        return false;
    }
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0') {
        return false;
    }
    *out = x;
    return true;
}

/*
 * Parse one allocation file.  Only newline-terminated lines count, so a half-appended line
 * is invisible.  Returns false for anything malformed (the file is then ignored).
 */
static bool parse_alloc(char *text, struct alloc *a)
{
    long long pid = -1;
    long long minor = -1;
    long long mib = -1;
    char *line = text;
    char *nl;

    memset(a, 0, sizeof *a);
    a->kind = KIND_COMPUTE;
    a->report_usage = true;
    while ((nl = strchr(line, '\n')) != NULL) {
        *nl = '\0';
        char *eq = strchr(line, '=');
        long long v = 0;
        if (eq != NULL) {
            *eq = '\0';
            const char *key = line;
            const char *val = eq + 1;
            bool number = parse_ll(val, &v);
            if (strcmp(key, "pid") == 0 || strcmp(key, "minor") == 0 ||
                strcmp(key, "mib") == 0 || strcmp(key, "report_usage") == 0) {
                if (!number) {
                    return false;
                }
                if (strcmp(key, "pid") == 0) {
                    pid = v;
                } else if (strcmp(key, "minor") == 0) {
                    minor = v;
                } else if (strcmp(key, "mib") == 0) {
                    mib = v;
                } else {
                    a->report_usage = v != 0;
                }
            } else if (strcmp(key, "kind") == 0) {
                if (strcmp(val, "compute") == 0) {
                    a->kind = KIND_COMPUTE;
                } else if (strcmp(val, "graphics") == 0) {
                    a->kind = KIND_GRAPHICS;
                } else if (strcmp(val, "mps") == 0) {
                    a->kind = KIND_MPS;
                } else {
                    return false;
                }
            } else if (strcmp(key, "released_at_ms") == 0 && !a->released && number) {
                a->released = true; /* the first valid release line wins */
                a->released_at_ms = v;
            }
        }
        line = nl + 1;
    }
    if (pid <= 0 || pid > 0xFFFFFFFFLL || minor < 0 || mib < 0) {
        return false; /* missing (still -1) or out of range */
    }
    a->pid = (unsigned int)pid;
    a->minor = minor;
    a->mib = mib;
    return true;
}

/* Every well-formed allocation file in $STATE/allocs. Caller frees *out. */
static size_t load_allocs(const struct state *st, struct alloc **out)
{
    char path[PATH_MAX + 300];
    size_t n = 0;
    size_t cap = 0;
    struct alloc *list = NULL;
    struct dirent *de;
    DIR *d;

    *out = NULL;
    snprintf(path, sizeof path, "%s/allocs", st->dir);
    d = opendir(path);
    if (d == NULL) {
        return 0;
    }
    while ((de = readdir(d)) != NULL) {
        size_t namelen = strlen(de->d_name);
        struct alloc a;
        char *text;
        if (de->d_name[0] == '.' ||
            (namelen >= 4 && strcmp(de->d_name + namelen - 4, ".tmp") == 0)) {
            continue; /* hidden or temporary: a writer has not renamed it into place yet */
        }
        snprintf(path, sizeof path, "%s/allocs/%s", st->dir, de->d_name);
        text = read_file(path, 65536, NULL);
        if (text == NULL) {
            continue;
        }
        bool ok = parse_alloc(text, &a);
        free(text);
        if (!ok) {
            continue;
        }
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 16;
            struct alloc *bigger = realloc(list, ncap * sizeof *list);
            if (bigger == NULL) {
                break;
            }
            list = bigger;
            cap = ncap;
        }
        list[n++] = a;
    }
    closedir(d);
    *out = list;
    return n;
}

/* Does this allocation still count on GPU g at time now? */
static bool alloc_counts(const struct alloc *a, const struct gpu_cfg *g, long long now)
{
    if (a->minor != g->minor) {
        return false;
    }
    if (!a->released) {
        return true;
    }
    return now < a->released_at_ms + (g->release_delay_ms > 0 ? g->release_delay_ms : 0);
}

/* MiB of counted allocations on g. */
static long long allocated_mib(const struct state *st, const struct gpu_cfg *g)
{
    struct alloc *list;
    size_t n = load_allocs(st, &list);
    long long now = now_realtime_ms();
    long long sum = 0;
    for (size_t i = 0; i < n; i++) {
        if (alloc_counts(&list[i], g, now)) {
            sum += list[i].mib;
        }
    }
    free(list);
    return sum;
}

struct proc_entry {
    unsigned int pid;
    long long mib;
    bool report_usage;
};

static int cmp_proc(const void *a, const void *b)
{
    unsigned int x = ((const struct proc_entry *)a)->pid;
    unsigned int y = ((const struct proc_entry *)b)->pid;
    return (x > y) - (x < y);
}

/* Distinct PIDs with counted allocations of this kind on g, sorted by PID. Caller frees. */
static size_t list_processes(const struct state *st, const struct gpu_cfg *g, enum kind kind,
                             struct proc_entry **out)
{
    struct alloc *list;
    size_t n = load_allocs(st, &list);
    long long now = now_realtime_ms();
    size_t m = 0;
    struct proc_entry *procs = calloc(n ? n : 1, sizeof *procs);

    *out = procs;
    if (procs == NULL) {
        free(list);
        return 0;
    }
    for (size_t i = 0; i < n; i++) {
        const struct alloc *a = &list[i];
        size_t k;
        if (a->kind != kind || !alloc_counts(a, g, now)) {
            continue;
        }
        for (k = 0; k < m && procs[k].pid != a->pid; k++) {
        }
        if (k == m) {
            procs[m].pid = a->pid;
            procs[m].report_usage = true;
            m++;
        }
        procs[k].mib += a->mib;
        procs[k].report_usage = procs[k].report_usage && a->report_usage;
    }
    free(list);
    qsort(procs, m, sizeof *procs, cmp_proc);
    return m;
}

/* ------------------------------------------------------------------------------------------ */
/* Call prologue: block if told to, load the state, check init, resolve the device.           */
/* ------------------------------------------------------------------------------------------ */

/*
 * block_call names this symbol: sleep block_ms, or with block_ms == 0 until gpus.json no
 * longer names it (checked every 50 ms), like a call stuck in a wedged driver.
 */
static void maybe_block(const char *symbol)
{
    struct state *st = load_state();
    if (st != NULL && strcmp(st->block_call, symbol) == 0) {
        if (st->block_ms > 0) {
            sleep_ms(st->block_ms);
        } else {
            for (;;) {
                sleep_ms(50);
                free(st);
                st = load_state();
                if (st == NULL || strcmp(st->block_call, symbol) != 0) {
                    break;
                }
            }
        }
    }
    free(st);
}

static bool is_initialized(void)
{
    pthread_mutex_lock(&g_lock);
    bool ok = g_init_refcount > 0;
    pthread_mutex_unlock(&g_lock);
    return ok;
}

/* Common start of every call after init: *out is a loaded state on success. */
static nvmlReturn_t begin(const char *symbol, struct state **out)
{
    *out = NULL;
    maybe_block(symbol);
    if (!is_initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    *out = load_state();
    if (*out == NULL) {
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    return NVML_SUCCESS;
}

static bool handle_slot(nvmlDevice_t device, unsigned int *slot)
{
    uintptr_t p = (uintptr_t)device;
    uintptr_t base = (uintptr_t)&g_devices[0];
    if (device == NULL || p < base || p >= base + sizeof g_devices ||
        (p - base) % sizeof g_devices[0] != 0) {
        return false;
    }
    *slot = (unsigned int)((p - base) / sizeof g_devices[0]);
    return true;
}

static nvmlReturn_t gpu_access(const struct gpu_cfg *g)
{
    if (g->lost) {
        return NVML_ERROR_GPU_IS_LOST;
    }
    if (g->no_permission) {
        return NVML_ERROR_NO_PERMISSION;
    }
    if (g->reset_required) {
        return NVML_ERROR_RESET_REQUIRED;
    }
    return NVML_SUCCESS;
}

/* begin() plus resolving a device handle to its GPU in the current state. */
static nvmlReturn_t begin_device(const char *symbol, nvmlDevice_t device, struct state **st,
                                 unsigned int *index, const struct gpu_cfg **gpu)
{
    nvmlReturn_t rc = begin(symbol, st);
    unsigned int slot;
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (!handle_slot(device, &slot) || slot >= (*st)->ngpus) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *index = slot;
    *gpu = &(*st)->gpus[slot];
    return gpu_access(*gpu);
}

static nvmlReturn_t copy_string(const char *value, char *buf, unsigned int length)
{
    if (buf == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (strlen(value) + 1 > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(buf, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Init / shutdown / errors                                                                   */
/* ------------------------------------------------------------------------------------------ */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    struct state *st;
    nvmlReturn_t rc;
    (void)flags;
    maybe_block("nvmlInitWithFlags");
    st = load_state();
    if (st == NULL) {
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    rc = (nvmlReturn_t)st->init_error;
    free(st);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    pthread_mutex_lock(&g_lock);
    g_init_refcount++;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    maybe_block("nvmlShutdown");
    pthread_mutex_lock(&g_lock);
    if (g_init_refcount == 0) {
        rc = NVML_ERROR_UNINITIALIZED;
    } else {
        g_init_refcount--;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    maybe_block("nvmlErrorString");
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt request issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request";
    case 18: return "RM has detected an NVML/RM version mismatch";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Insufficient resources for request";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 30: return "Reset type not supported";
    default: return "Unknown Error";
    }
}

/* ------------------------------------------------------------------------------------------ */
/* System queries                                                                             */
/* ------------------------------------------------------------------------------------------ */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    struct state *st;
    nvmlReturn_t rc = begin("nvmlSystemGetDriverVersion", &st);
    if (rc == NVML_SUCCESS) {
        rc = copy_string(st->driver_version, version, length);
    }
    free(st);
    return rc;
}

/* argv[0] from /proc/PID/cmdline, else /proc/PID/comm: what nvidia-smi shows as the name. */
nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    struct state *st;
    char path[64];
    char *text;
    nvmlReturn_t rc = begin("nvmlSystemGetProcessName", &st);
    free(st);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (name == NULL || length == 0) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    snprintf(path, sizeof path, "/proc/%u/cmdline", pid);
    text = read_file(path, 1 << 16, NULL);
    if (text != NULL && text[0] == '\0') {
        free(text);
        snprintf(path, sizeof path, "/proc/%u/comm", pid);
        text = read_file(path, 4096, NULL);
        if (text != NULL) {
            text[strcspn(text, "\n")] = '\0';
        }
    }
    if (text == NULL) {
        return NVML_ERROR_NOT_FOUND;
    }
    rc = copy_string(text, name, length);
    free(text);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* Device enumeration and identity                                                            */
/* ------------------------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    struct state *st;
    nvmlReturn_t rc = begin("nvmlDeviceGetCount_v2", &st);
    if (rc == NVML_SUCCESS) {
        if (deviceCount == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *deviceCount = st->ngpus; /* all GPUs, also those that refuse a handle */
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    struct state *st;
    nvmlReturn_t rc = begin("nvmlDeviceGetHandleByIndex_v2", &st);
    if (rc == NVML_SUCCESS) {
        if (device == NULL || index >= st->ngpus) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            rc = gpu_access(&st->gpus[index]);
            if (rc == NVML_SUCCESS) {
                *device = &g_devices[index];
            }
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    struct state *st;
    nvmlReturn_t rc = begin("nvmlDeviceGetHandleByUUID", &st);
    if (rc == NVML_SUCCESS) {
        rc = NVML_ERROR_NOT_FOUND;
        if (uuid == NULL || device == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            for (unsigned int i = 0; i < st->ngpus; i++) {
                if (strcmp(st->gpus[i].uuid, uuid) == 0) {
                    rc = gpu_access(&st->gpus[i]);
                    if (rc == NVML_SUCCESS) {
                        *device = &g_devices[i];
                    }
                    break;
                }
            }
        }
    }
    free(st);
    return rc;
}

/* "domain:bus:device.function" in hex; the domain may have 4 or 8 digits. */
static bool parse_bus_id(const char *s, unsigned int *domain, unsigned int *bus,
                         unsigned int *dev, unsigned int *fn)
{
    char tail;
    return s != NULL && sscanf(s, "%x:%x:%x.%x%c", domain, bus, dev, fn, &tail) == 4;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    struct state *st;
    unsigned int d1, b1, v1, f1, d2, b2, v2, f2;
    nvmlReturn_t rc = begin("nvmlDeviceGetHandleByPciBusId_v2", &st);
    if (rc == NVML_SUCCESS) {
        rc = NVML_ERROR_NOT_FOUND;
        if (pciBusId == NULL || device == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            bool parsed = parse_bus_id(pciBusId, &d1, &b1, &v1, &f1);
            for (unsigned int i = 0; i < st->ngpus; i++) {
                const char *mine = st->gpus[i].pci_bus_id;
                bool same = parsed && parse_bus_id(mine, &d2, &b2, &v2, &f2)
                                ? (d1 == d2 && b1 == b2 && v1 == v2 && f1 == f2)
                                : strcasecmp(mine, pciBusId) == 0;
                if (same) {
                    rc = gpu_access(&st->gpus[i]);
                    if (rc == NVML_SUCCESS) {
                        *device = &g_devices[i];
                    }
                    break;
                }
            }
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetName", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        rc = copy_string(g->name, name, length);
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetUUID", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        rc = copy_string(g->uuid, uuid, length);
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *out)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetIndex", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (out == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *out = index;
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetMinorNumber", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (minorNumber == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            *minorNumber = (unsigned int)g->minor;
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, fake_pci_info *pci)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    unsigned int domain, bus, dev, fn;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetPciInfo_v3", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (pci == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            memset(pci, 0, sizeof *pci);
            if (parse_bus_id(g->pci_bus_id, &domain, &bus, &dev, &fn)) {
                pci->domain = domain;
                pci->bus = bus;
                pci->device = dev;
                snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, dev,
                         fn & 0xF);
                snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X",
                         domain & 0xFFFF, bus & 0xFF, dev & 0xFF, fn & 0xF);
            } else {
                copy_utf8(pci->busId, sizeof pci->busId, g->pci_bus_id);
                copy_utf8(pci->busIdLegacy, sizeof pci->busIdLegacy, g->pci_bus_id);
            }
            pci->pciDeviceId = (unsigned int)g->pci_device_id;
            pci->pciSubSystemId = (unsigned int)g->pci_subsystem_id;
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                  unsigned int *pendingMode)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetMigMode", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (currentMode == NULL || pendingMode == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (g->mig_mode < 0) {
            rc = NVML_ERROR_NOT_SUPPORTED; /* nvml.h: "device doesn't support MIG mode" */
        } else {
            /* NVML_DEVICE_MIG_DISABLE 0, NVML_DEVICE_MIG_ENABLE 1 */
            *currentMode = g->mig_mode != 0;
            *pendingMode = g->mig_pending < 0 ? *currentMode : g->mig_pending != 0;
        }
    }
    free(st);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory                                                                                     */
/* ------------------------------------------------------------------------------------------ */

struct memory_numbers {
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long used_v2; /* allocated: idle baseline + counted allocations + unattributed */
};

static unsigned long long mib_bytes(long long mib)
{
    return mib > 0 ? (unsigned long long)mib * MIB : 0;
}

static struct memory_numbers memory_numbers(const struct state *st, const struct gpu_cfg *g)
{
    struct memory_numbers m;
    m.total = mib_bytes(g->total_mib);
    m.reserved = mib_bytes(g->reserved_mib);
    m.used_v2 = mib_bytes(g->used_mib) + mib_bytes(allocated_mib(st, g)) +
                mib_bytes(g->unattributed_mib);
    return m;
}

static unsigned long long minus(unsigned long long a, unsigned long long b)
{
    return a > b ? a - b : 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, fake_memory_v1 *memory)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetMemoryInfo", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (memory == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (g->memory_not_supported) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else {
            struct memory_numbers m = memory_numbers(st, g);
#ifdef FAKENVML_OLD_DRIVER
            /* Before R510 the reserved carve-out was hidden from total, not counted as used. */
            memory->total = minus(m.total, m.reserved);
            memory->used = m.used_v2;
#else
            /* Since R510 the v1 call lumps the reserved carve-out into used. */
            memory->total = m.total;
            memory->used = m.used_v2 + m.reserved;
#endif
            memory->free = minus(memory->total, memory->used);
        }
    }
    free(st);
    return rc;
}

#ifndef FAKENVML_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, fake_memory_v2 *memory)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetMemoryInfo_v2", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (memory == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (memory->version != MEMORY_V2_VERSION) {
            rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
        } else if (g->memory_not_supported) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else {
            struct memory_numbers m = memory_numbers(st, g);
            memory->total = m.total;
            memory->reserved = m.reserved;
            memory->used = m.used_v2;
            memory->free = minus(m.total, m.used_v2 + m.reserved);
        }
    }
    free(st);
    return rc;
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* Health: page retirement, row remapping, ECC counters, the driver's recovery action          */
/* ------------------------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *isPending)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetRetiredPagesPendingStatus", device, &st, &index,
                                   &g);
    if (rc == NVML_SUCCESS) {
        if (isPending == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (g->retired_pages_pending < 0) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else {
            *isPending = g->retired_pages_pending != 0; /* nvmlEnableState_t */
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetPersistenceMode", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (mode == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (g->persistence_mode < 0) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else {
            *mode = g->persistence_mode != 0; /* nvmlEnableState_t */
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                       unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetRemappedRows", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (corrRows == NULL || uncRows == NULL || isPending == NULL || failureOccurred == NULL) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (g->remapped_rows_pending < 0) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else {
            *corrRows = 0;
            *uncRows = g->remapped_rows_pending != 0 ? 1u : 0u;
            *isPending = g->remapped_rows_pending != 0;
            *failureOccurred = g->remapped_rows_failure != 0;
        }
    }
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                         unsigned long long *eccCounts)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetTotalEccErrors", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (eccCounts == NULL || errorType < 0 || errorType > 1 || counterType < 0 ||
            counterType > 1) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else if (g->ecc_volatile_uncorrected < 0) {
            rc = NVML_ERROR_NOT_SUPPORTED;
        } else if (errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED &&
                   counterType == NVML_VOLATILE_ECC) {
            *eccCounts = (unsigned long long)g->ecc_volatile_uncorrected;
        } else {
            *eccCounts = 0;
        }
    }
    free(st);
    return rc;
}

/* Only the recovery action field is known; every other field answers NOT_SUPPORTED in its own
 * slot while the call itself succeeds, as the real library does for fields a GPU lacks. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                      fake_field_value *values)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    nvmlReturn_t rc = begin_device("nvmlDeviceGetFieldValues", device, &st, &index, &g);
    if (rc == NVML_SUCCESS) {
        if (values == NULL || valuesCount < 0) {
            rc = NVML_ERROR_INVALID_ARGUMENT;
        } else {
            for (int i = 0; i < valuesCount; i++) {
                fake_field_value *v = &values[i];
                v->timestamp = now_realtime_ms() * 1000;
                v->latencyUsec = 0;
                v->value = 0;
#ifdef FAKENVML_OLD_DRIVER
                bool known = false;
#else
                bool known = v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION &&
                             g->recovery_action >= 0;
#endif
                if (known) {
                    v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
                    v->nvmlReturn = NVML_SUCCESS;
                    v->value = (unsigned int)g->recovery_action;
                } else {
                    v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
                }
            }
        }
    }
    free(st);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* Running processes: the two-call size protocol                                              */
/* ------------------------------------------------------------------------------------------ */

/* Should this second call pretend the list grew (process_list_race)? Counts per GPU index. */
static bool take_race(unsigned int index, long long races)
{
    bool race = false;
    pthread_mutex_lock(&g_lock);
    if (g_races_done[index] < races) {
        g_races_done[index]++;
        race = true;
    }
    pthread_mutex_unlock(&g_lock);
    return race;
}

static nvmlReturn_t running_processes(const char *symbol, nvmlDevice_t device, enum kind kind,
                                      unsigned int *infoCount, fake_process_info *infos)
{
    struct state *st;
    unsigned int index;
    const struct gpu_cfg *g;
    struct proc_entry *procs = NULL;
    nvmlReturn_t rc = begin_device(symbol, device, &st, &index, &g);
    if (rc != NVML_SUCCESS) {
        free(st);
        return rc;
    }
    if (infoCount == NULL) {
        free(st);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    size_t n = list_processes(st, g, kind, &procs);
    unsigned int capacity = *infoCount;
    if (infos != NULL && capacity > 0 && take_race(index, g->process_list_race)) {
        /* The list "grew" between the sizing call and this one. */
        *infoCount = (unsigned int)(n > capacity ? n : capacity) + 1;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else if (n == 0) {
        *infoCount = 0;
        rc = NVML_SUCCESS;
    } else if (capacity < n) {
        *infoCount = (unsigned int)n;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else if (infos == NULL) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        for (size_t i = 0; i < n; i++) {
            infos[i].pid = procs[i].pid;
            infos[i].usedGpuMemory = procs[i].report_usage ? mib_bytes(procs[i].mib)
                                                           : NOT_AVAILABLE_ULL;
            infos[i].gpuInstanceId = NO_INSTANCE;
            infos[i].computeInstanceId = NO_INSTANCE;
        }
        *infoCount = (unsigned int)n;
        rc = NVML_SUCCESS;
    }
    free(procs);
    free(st);
    return rc;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                     unsigned int *infoCount,
                                                     fake_process_info *infos)
{
    return running_processes("nvmlDeviceGetComputeRunningProcesses_v2", device, KIND_COMPUTE,
                             infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device,
                                                      unsigned int *infoCount,
                                                      fake_process_info *infos)
{
    return running_processes("nvmlDeviceGetGraphicsRunningProcesses_v2", device, KIND_GRAPHICS,
                             infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device,
                                                        unsigned int *infoCount,
                                                        fake_process_info *infos)
{
    return running_processes("nvmlDeviceGetMPSComputeRunningProcesses_v2", device, KIND_MPS,
                             infoCount, infos);
}

#ifndef FAKENVML_OLD_DRIVER
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                     unsigned int *infoCount,
                                                     fake_process_info *infos)
{
    return running_processes("nvmlDeviceGetComputeRunningProcesses_v3", device, KIND_COMPUTE,
                             infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                      unsigned int *infoCount,
                                                      fake_process_info *infos)
{
    return running_processes("nvmlDeviceGetGraphicsRunningProcesses_v3", device, KIND_GRAPHICS,
                             infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device,
                                                        unsigned int *infoCount,
                                                        fake_process_info *infos)
{
    return running_processes("nvmlDeviceGetMPSComputeRunningProcesses_v3", device, KIND_MPS,
                             infoCount, infos);
}
#endif
