/* The C consumer: libcudamem_c through its installed package (find_package(cudamem_c)), from
 * plain C. On a machine with a GPU it allocates and frees 1 MiB on device 0 through the
 * process-wide allocator and prints "consumer_c: OK ..."; on one without, the allocation fails
 * with CUDAMEM_ERROR_NO_DEVICE and it prints the library's no-device message and exits 69
 * (EX_UNAVAILABLE), as the C++ consumers do. Anything else is a failure. */
#include <cudamem_c.h>

#include <stdio.h>

enum { exit_no_device = 69 };

int main(void) {
  printf("consumer_c: cudamem %s\n", cudamem_version());
  const size_t bytes = (size_t)1 << 20;
  void* p = NULL;
  const cudamem_status status = cudamem_allocate(0, bytes, 0, NULL, &p);
  if (status == CUDAMEM_ERROR_NO_DEVICE) {
    printf("consumer_c: %s\n", cudamem_last_error());
    return exit_no_device;
  }
  if (status != CUDAMEM_OK) {
    fprintf(stderr, "consumer_c failed: cudamem_allocate returned %d: %s\n", (int)status,
            cudamem_last_error());
    return 1;
  }
  if (cudamem_deallocate(0, p, bytes, 0, NULL) != CUDAMEM_OK) {
    fprintf(stderr, "consumer_c failed: cudamem_deallocate: %s\n", cudamem_last_error());
    return 1;
  }
  printf("consumer_c: OK, 1 MiB allocated and freed on device 0\n");
  return 0;
}
