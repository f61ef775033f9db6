// cudamem/detail/spare_nodes.hpp — the nodes of a node-based standard container (std::map,
// std::set, std::unordered_map), kept when elements are erased and reused by the next inserts,
// so that a container whose size goes up and down by a few allocates nothing in the steady
// state.
//
//   std::map<std::uintptr_t, info> live;
//   spare_nodes<std::map<std::uintptr_t, info>> spares;
//   auto it = spares.insert(live, address, info{...});   // a kept node, else a new one
//   spares.erase(live, it);                              // the node is kept (up to 8)
//
// Why. vm_resource records every block it hands out and every free range in such containers;
// each record used to be a malloc and each erase a free: on the mixed trace, one of each per
// operation, on a path whose other work is a few hundred nanoseconds. A node handle
// (C++17 extract/insert) lets the allocation outlive the element.
//
// Contract. `erase` and `keep` never allocate and never throw (the room for the kept nodes is
// reserved at construction, which may throw std::bad_alloc). `insert` throws what the
// container's own insert throws (std::bad_alloc: a new node, or an unordered container's
// rehash), and then inserts nothing. A key already present is not replaced (as emplace).
// Not thread-safe: the container's owner locks.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace cudamem::detail {

template <class Container, std::size_t Capacity = 8>
class spare_nodes {
 public:
  using node_type = typename Container::node_type;

  spare_nodes() { nodes_.reserve(Capacity); }
  // Out of line on purpose: inlined into the destructor of a std::optional<vm_pool_resource>,
  // g++ 12 at -O1 and -O3 warns that the vector's pointers "may be used uninitialized" (a false
  // positive that fails a user's -Werror build). It runs once, when the owner goes.
  [[gnu::noinline]] ~spare_nodes() {}
  spare_nodes(spare_nodes&&) noexcept = default;
  spare_nodes& operator=(spare_nodes&&) noexcept = default;

  /// Erases the element at `it` from `c`, keeping its node while there is room.
  void erase(Container& c, typename Container::const_iterator it) noexcept { keep(c.extract(it)); }

  /// Keeps an extracted node for a later insert, or frees it when Capacity are kept already.
  void keep(node_type&& node) noexcept {
    if (!node.empty() && nodes_.size() < Capacity) {
      nodes_.push_back(std::move(node));  // within the reserved room: no allocation
    }
  }

  /// Inserts the element `key` (a set) or `key` -> `mapped` (a map) into `c`, in a kept node
  /// when there is one; returns where it is.
  template <class Key, class... Mapped>
  typename Container::iterator insert(Container& c, Key&& key, Mapped&&... mapped) {
    if (nodes_.empty()) {
      return c.emplace(std::forward<Key>(key), std::forward<Mapped>(mapped)...).first;
    }
    node_type node = std::move(nodes_.back());
    nodes_.pop_back();
    if constexpr (sizeof...(Mapped) == 0) {
      node.value() = std::forward<Key>(key);
    } else {
      node.key() = std::forward<Key>(key);
      node.mapped() = typename Container::mapped_type(std::forward<Mapped>(mapped)...);
    }
    return c.insert(std::move(node)).position;  // on a throw `node` frees itself
  }

  [[nodiscard]] std::size_t size() const noexcept { return nodes_.size(); }

 private:
  std::vector<node_type> nodes_;
};

}  // namespace cudamem::detail
