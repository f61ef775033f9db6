/* The driver (libcuda.so.1) beside runtime.c's pretend runtime: PyTorch loads it by name at
   CUDA initialisation. It answers the few calls made at start-up; any entry point looked up
   by name is "not found", so nothing reaches a real driver. See runtime.c. */
typedef int CUresult;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_FOUND = 500 };

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int* version) { *version = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int* count) { *count = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(int* device, int ordinal) { *device = ordinal; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(void** context) { *context = (void*)0x10; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxGetState(int device, unsigned int* flags, int* active) {
  (void)device;
  *flags = 0;
  *active = 1;
  return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult error, const char** text) {
  (void)error;
  *text = "fake GPU";
  return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult error, const char** text) {
  (void)error;
  *text = "CUDA_ERROR_FAKE_GPU";
  return CUDA_SUCCESS;
}
CUresult cuGetProcAddress(const char* symbol, void** function, int version,
                          unsigned long long flags) {
  (void)symbol; (void)version; (void)flags;
  *function = 0;
  return CUDA_ERROR_NOT_FOUND;
}
CUresult cuGetProcAddress_v2(const char* symbol, void** function, int version,
                             unsigned long long flags, int* status) {
  (void)symbol; (void)version; (void)flags;
  *function = 0;
  if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  return CUDA_ERROR_NOT_FOUND;
}
