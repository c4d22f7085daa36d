/* Test-only stand-in for the CUDA driver, built with gcc by the tests.
 *
 * kvikio loads libcuda.so.1 even in compat mode and even for host buffers.
 * This stub answers every driver call with CUDA_ERROR_NOT_INITIALIZED (3),
 * except cuDriverGetVersion (kvikio's loader must succeed) and the two
 * error-text calls, so kvikio takes its compat path and does real POSIX I/O
 * on host buffers. It never pretends to have a device.
 */
typedef int CUresult;
#define NOT_INITIALIZED 3

CUresult cuDriverGetVersion(int *version) { *version = 12000; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_ERROR_NOT_INITIALIZED"; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "stub libcuda: no CUDA driver"; return 0; }

#define NI(name) CUresult name(void) { return NOT_INITIALIZED; }
NI(cuInit) NI(cuMemHostAlloc) NI(cuMemFreeHost) NI(cuMemHostRegister) NI(cuMemHostRegister_v2)
NI(cuMemHostUnregister) NI(cuMemcpyAsync) NI(cuMemcpyHtoDAsync) NI(cuMemcpyHtoDAsync_v2)
NI(cuMemcpyDtoHAsync) NI(cuMemcpyDtoHAsync_v2) NI(cuMemcpyBatchAsync) NI(cuMemcpyBatchAsync_v2)
NI(cuPointerGetAttribute) NI(cuPointerGetAttributes) NI(cuMemGetAddressRange) NI(cuMemGetAddressRange_v2)
NI(cuCtxCreate) NI(cuCtxCreate_v2) NI(cuCtxDestroy) NI(cuCtxDestroy_v2) NI(cuCtxPushCurrent)
NI(cuCtxPushCurrent_v2) NI(cuCtxPopCurrent) NI(cuCtxPopCurrent_v2) NI(cuCtxGetCurrent) NI(cuCtxGetDevice)
NI(cuDeviceGet) NI(cuDeviceGetCount) NI(cuDeviceGetAttribute) NI(cuDevicePrimaryCtxRetain)
NI(cuDevicePrimaryCtxRelease) NI(cuDevicePrimaryCtxRelease_v2) NI(cuStreamCreate) NI(cuStreamDestroy)
NI(cuStreamDestroy_v2) NI(cuStreamSynchronize) NI(cuEventCreate) NI(cuEventDestroy) NI(cuEventDestroy_v2)
NI(cuEventRecord) NI(cuEventQuery) NI(cuEventSynchronize) NI(cuLaunchHostFunc)
