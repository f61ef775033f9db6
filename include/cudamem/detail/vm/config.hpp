// cudamem/detail/vm/config.hpp — the sizes and limits a vm_resource works with, fixed at
// construction from its options (`vm_config`: granule, handle, growth, physical limit,
// reservation, the floors of growth ahead and of keep_free), checked there; and the count of
// what the driver was asked to do (`vm_call_counts`, what vm_stats reports); and
// `no_growth_into_reserve_scope` and `growth_held_back`, for a vm_pool's bulk blocks.
//
//   detail::vm_config c = detail::vm_config::from(layer, options);  // invalid_argument if bad
//   std::size_t size = detail::vm_config::round_up(bytes, c.granule);
//
// Part of vm_resource.hpp, whose contract lists the options' bad values; every other part
// reads its sizes from here.
#pragma once

#include <cudamem/detail/thread_flag_scope.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/detail/vm/options.hpp>  // default_grow_ahead_floor, max_recent_frees

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace cudamem::detail {

/// The sizes and limits vm_resource works with, fixed at construction.
struct vm_config {
  std::size_t granule = 0;                    ///< mapping granularity
  std::size_t handle = 0;                     ///< bytes of a handle, a granule multiple
  std::size_t growth = 0;                     ///< least bytes a growth creates
  std::size_t limit = ~std::size_t{0};        ///< most physical bytes (physical_limit)
  std::size_t reservation = 0;                ///< bytes of one address-space reservation
  std::size_t reservations_before_sweep = 0;
  std::size_t ahead_floor = 0;  ///< free device memory growth ahead leaves (resolved option)
  std::size_t keep_free = 0;    ///< free device memory growth for a request leaves if it can
  std::size_t recent_frees = 0;  ///< blocks of whole handles kept aside once freed
  bool exportable = false;       ///< block_handles and handles_covering may be asked

  /// The config of a vm_resource with options `o` (a vm_resource_options) over `layer`;
  /// throws std::invalid_argument for a null layer or options no resource can work with.
  template <class Options>
  [[nodiscard]] static vm_config from(const vm_mapping_layer* layer, const Options& o) {
    if (layer == nullptr) {
      throw std::invalid_argument("cudamem::vm_resource: null mapping layer");
    }
    if (o.handle_bytes == 0) {
      throw std::invalid_argument("cudamem::vm_resource: handle_bytes must not be 0");
    }
    if (o.reservations_before_sweep == 0) {
      throw std::invalid_argument(
          "cudamem::vm_resource: reservations_before_sweep must not be 0");
    }
    if (o.recent_frees > max_recent_frees) {
      throw std::invalid_argument("cudamem::vm_resource: recent_frees must be at most " +
                                  std::to_string(max_recent_frees) + ", not " +
                                  std::to_string(o.recent_frees));
    }
    vm_config c;
    c.granule = layer->granularity();
    c.handle = round_up(o.handle_bytes, c.granule);
    if (o.physical_limit && *o.physical_limit < c.handle) {
      throw std::invalid_argument(
          "cudamem::vm_resource: physical_limit is smaller than one handle (" +
          std::to_string(c.handle) + " bytes): it could never map anything");
    }
    c.growth = o.growth_bytes;
    c.limit = o.physical_limit.value_or(~std::size_t{0});
    c.reservation =
        round_up(o.reserve_bytes != 0 ? o.reserve_bytes : 4 * layer->device_total(), c.granule);
    c.reservations_before_sweep = o.reservations_before_sweep;
    c.ahead_floor = std::max(
        o.grow_ahead_floor_bytes.value_or(default_grow_ahead_floor(layer->device_total())),
        o.keep_free_bytes);
    c.keep_free = o.keep_free_bytes;
    c.recent_frees = o.recent_frees;
    c.exportable = o.exportable;
    return c;
  }

  /// Where reservations start: at a multiple of the handle when it is a power of two (handles
  /// then sit at multiples of their size; see handle_set::place_whole), else of the granule.
  [[nodiscard]] constexpr std::size_t reservation_alignment() const noexcept {
    return (handle & (handle - 1)) == 0 ? handle : granule;
  }

  [[nodiscard]] static constexpr std::size_t round_up(std::size_t n, std::size_t unit) noexcept {
    return (n + unit - 1) / unit * unit;
  }
};

/// What the driver was asked to do (vm_stats reports these).
struct vm_call_counts {
  std::size_t compactions = 0;
  std::size_t handles_created = 0;
  std::size_t maps = 0;
  std::size_t access_calls = 0;
  std::size_t unmaps = 0;
  std::size_t handles_created_ahead = 0;  ///< of handles_created: by the growth thread
  std::size_t bytes_given_back_ahead = 0;  ///< by release_tail (trim, or for other resources)
  std::size_t kept_free_compactions = 0;   ///< of compactions: chosen over growth by keep_free
};

/// Set on a thread whose request found a vm_resource's growth held back (by keep_free_bytes
/// or a full device): a vm_pool clears it, asks, and then has its bulk resource give back
/// its free handles (detail/vm/pool_sources.hpp says why). Never cleared by a vm_resource.
inline thread_local bool growth_held_back = false;

/// True on a thread whose requests may not grow a vm_resource into its keep_free reserve.
inline thread_local bool growth_into_reserve_refused = false;

/// While it lives, a vm_resource's request on this thread that recycling cannot serve fails
/// instead of growing below keep_free_bytes: a vm_pool's bulk blocks then go to its other
/// vm_resource, which holds the memory already (detail/vm/pool_sources.hpp). Growth above
/// keep_free, and with keep_free_bytes 0 growth and probes of a full device, are as before.
class no_growth_into_reserve_scope : thread_flag_scope {
 public:
  no_growth_into_reserve_scope() noexcept : thread_flag_scope(growth_into_reserve_refused) {}
};

}  // namespace cudamem::detail
