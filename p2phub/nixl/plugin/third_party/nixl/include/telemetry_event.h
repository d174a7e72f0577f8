/*
 * SPDX-FileCopyrightText: Copyright (c) 2025-2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Licensed under the Apache License, Version 2.0 (the "License");
 * you may not use this file except in compliance with the License.
 * You may obtain a copy of the License at
 *
 * http://www.apache.org/licenses/LICENSE-2.0
 *
 * Unless required by applicable law or agreed to in writing, software
 * distributed under the License is distributed on an "AS IS" BASIS,
 * WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
 * See the License for the specific language governing permissions and
 * limitations under the License.
 */
#ifndef NIXL_SRC_CORE_TELEMETRY_TELEMETRY_EVENT_H
#define NIXL_SRC_CORE_TELEMETRY_TELEMETRY_EVENT_H

#include <array>
#include <cstdint>
#include <string_view>

#include "nixl_types.h"

constexpr char TELEMETRY_BUFFER_SIZE_VAR[] = "NIXL_TELEMETRY_BUFFER_SIZE";
constexpr char TELEMETRY_RUN_INTERVAL_VAR[] = "NIXL_TELEMETRY_RUN_INTERVAL";
constexpr char TELEMETRY_ENABLED_METRICS_VAR[] = "NIXL_TELEMETRY_ENABLED_METRICS";

constexpr inline int TELEMETRY_VERSION = 4;

/**
 * @enum nixl_telemetry_event_type_t
 * @brief Enumerates all known telemetry event types.
 */
enum class nixl_telemetry_event_type_t : uint32_t {
    AGENT_TX_BYTES = 0,
    AGENT_RX_BYTES = 1,
    AGENT_TX_REQUESTS_NUM = 2,
    AGENT_RX_REQUESTS_NUM = 3,
    AGENT_MEMORY_REGISTERED = 4,
    AGENT_MEMORY_DEREGISTERED = 5,
    AGENT_XFER_TIME = 6,
    AGENT_XFER_POST_TIME = 7,
    AGENT_ERR_NOT_POSTED = 8,
    AGENT_ERR_INVALID_PARAM = 9,
    AGENT_ERR_BACKEND = 10,
    AGENT_ERR_NOT_FOUND = 11,
    AGENT_ERR_MISMATCH = 12,
    AGENT_ERR_NOT_ALLOWED = 13,
    AGENT_ERR_REPOST_ACTIVE = 14,
    AGENT_ERR_UNKNOWN = 15,
    AGENT_ERR_NOT_SUPPORTED = 16,
    AGENT_ERR_REMOTE_DISCONNECT = 17,
    AGENT_ERR_CANCELED = 18,
    AGENT_ERR_NO_TELEMETRY = 19,
    AGENT_TELEMETRY_EVENTS_DROPPED = 20,
};

inline constexpr std::size_t nixl_telemetry_event_type_count =
    static_cast<std::size_t>(nixl_telemetry_event_type_t::AGENT_TELEMETRY_EVENTS_DROPPED) + 1;

// Per-event-type flag mask indexed by nixl_telemetry_event_type_t.
using nixl_telemetry_metric_mask_t = std::array<bool, nixl_telemetry_event_type_count>;

[[nodiscard]] nixl_telemetry_event_type_t
nixlTelemetryEventTypeForStatus(nixl_status_t s);

inline constexpr std::array telemetry_error_event_types = {
    nixl_telemetry_event_type_t::AGENT_ERR_NOT_POSTED,
    nixl_telemetry_event_type_t::AGENT_ERR_INVALID_PARAM,
    nixl_telemetry_event_type_t::AGENT_ERR_BACKEND,
    nixl_telemetry_event_type_t::AGENT_ERR_NOT_FOUND,
    nixl_telemetry_event_type_t::AGENT_ERR_MISMATCH,
    nixl_telemetry_event_type_t::AGENT_ERR_NOT_ALLOWED,
    nixl_telemetry_event_type_t::AGENT_ERR_REPOST_ACTIVE,
    nixl_telemetry_event_type_t::AGENT_ERR_UNKNOWN,
    nixl_telemetry_event_type_t::AGENT_ERR_NOT_SUPPORTED,
    nixl_telemetry_event_type_t::AGENT_ERR_REMOTE_DISCONNECT,
    nixl_telemetry_event_type_t::AGENT_ERR_CANCELED,
    nixl_telemetry_event_type_t::AGENT_ERR_NO_TELEMETRY,
};

inline constexpr std::array telemetry_metric_event_types = {
    nixl_telemetry_event_type_t::AGENT_TX_BYTES,
    nixl_telemetry_event_type_t::AGENT_RX_BYTES,
    nixl_telemetry_event_type_t::AGENT_TX_REQUESTS_NUM,
    nixl_telemetry_event_type_t::AGENT_RX_REQUESTS_NUM,
    nixl_telemetry_event_type_t::AGENT_MEMORY_REGISTERED,
    nixl_telemetry_event_type_t::AGENT_MEMORY_DEREGISTERED,
    nixl_telemetry_event_type_t::AGENT_XFER_TIME,
    nixl_telemetry_event_type_t::AGENT_XFER_POST_TIME,
    nixl_telemetry_event_type_t::AGENT_TELEMETRY_EVENTS_DROPPED,
};

static_assert(nixl_telemetry_event_type_count ==
                  telemetry_metric_event_types.size() + telemetry_error_event_types.size(),
              "AGENT_TELEMETRY_EVENTS_DROPPED must remain the last enumerator; "
              "nixl_telemetry_event_type_count is out of sync with the event-type enum");

// The error events share one family, so they have no per-type descriptor row.
inline constexpr const char *telemetry_error_family_name = "agent_errors_total";
inline constexpr const char *telemetry_error_family_help = "Cumulative error count by status";

struct nixlTelemetryMetricDescriptor {
    const char *counterName;
    const char *counterHelp;
    const char *gaugeName;
    const char *gaugeHelp;
    const char *histogramName;
    const char *histogramHelp;
};

namespace nixlEnumStrings {
[[nodiscard]] constexpr std::string_view
telemetryEventTypeStr(const nixl_telemetry_event_type_t type) noexcept {
    switch (type) {
    case nixl_telemetry_event_type_t::AGENT_TX_BYTES:
        return "agent_tx_bytes";
    case nixl_telemetry_event_type_t::AGENT_RX_BYTES:
        return "agent_rx_bytes";
    case nixl_telemetry_event_type_t::AGENT_TX_REQUESTS_NUM:
        return "agent_tx_requests_num";
    case nixl_telemetry_event_type_t::AGENT_RX_REQUESTS_NUM:
        return "agent_rx_requests_num";
    case nixl_telemetry_event_type_t::AGENT_MEMORY_REGISTERED:
        return "agent_memory_registered";
    case nixl_telemetry_event_type_t::AGENT_MEMORY_DEREGISTERED:
        return "agent_memory_deregistered";
    case nixl_telemetry_event_type_t::AGENT_XFER_TIME:
        return "agent_xfer_time";
    case nixl_telemetry_event_type_t::AGENT_XFER_POST_TIME:
        return "agent_xfer_post_time";
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_POSTED:
        return "agent_err_not_posted";
    case nixl_telemetry_event_type_t::AGENT_ERR_INVALID_PARAM:
        return "agent_err_invalid_param";
    case nixl_telemetry_event_type_t::AGENT_ERR_BACKEND:
        return "agent_err_backend";
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_FOUND:
        return "agent_err_not_found";
    case nixl_telemetry_event_type_t::AGENT_ERR_MISMATCH:
        return "agent_err_mismatch";
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_ALLOWED:
        return "agent_err_not_allowed";
    case nixl_telemetry_event_type_t::AGENT_ERR_REPOST_ACTIVE:
        return "agent_err_repost_active";
    case nixl_telemetry_event_type_t::AGENT_ERR_UNKNOWN:
        return "agent_err_unknown";
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_SUPPORTED:
        return "agent_err_not_supported";
    case nixl_telemetry_event_type_t::AGENT_ERR_REMOTE_DISCONNECT:
        return "agent_err_remote_disconnect";
    case nixl_telemetry_event_type_t::AGENT_ERR_CANCELED:
        return "agent_err_canceled";
    case nixl_telemetry_event_type_t::AGENT_ERR_NO_TELEMETRY:
        return "agent_err_no_telemetry";
    case nixl_telemetry_event_type_t::AGENT_TELEMETRY_EVENTS_DROPPED:
        return "agent_telemetry_events_dropped";
    }
    return "unknown_event";
}

[[nodiscard]] constexpr const char *
telemetryErrorStatusLabel(const nixl_telemetry_event_type_t type) noexcept {
    switch (type) {
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_POSTED:
        return "not_posted";
    case nixl_telemetry_event_type_t::AGENT_ERR_INVALID_PARAM:
        return "invalid_param";
    case nixl_telemetry_event_type_t::AGENT_ERR_BACKEND:
        return "backend";
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_FOUND:
        return "not_found";
    case nixl_telemetry_event_type_t::AGENT_ERR_MISMATCH:
        return "mismatch";
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_ALLOWED:
        return "not_allowed";
    case nixl_telemetry_event_type_t::AGENT_ERR_REPOST_ACTIVE:
        return "repost_active";
    case nixl_telemetry_event_type_t::AGENT_ERR_UNKNOWN:
        return "unknown";
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_SUPPORTED:
        return "not_supported";
    case nixl_telemetry_event_type_t::AGENT_ERR_REMOTE_DISCONNECT:
        return "remote_disconnect";
    case nixl_telemetry_event_type_t::AGENT_ERR_CANCELED:
        return "canceled";
    case nixl_telemetry_event_type_t::AGENT_ERR_NO_TELEMETRY:
        return "no_telemetry";
    case nixl_telemetry_event_type_t::AGENT_TX_BYTES:
    case nixl_telemetry_event_type_t::AGENT_RX_BYTES:
    case nixl_telemetry_event_type_t::AGENT_TX_REQUESTS_NUM:
    case nixl_telemetry_event_type_t::AGENT_RX_REQUESTS_NUM:
    case nixl_telemetry_event_type_t::AGENT_MEMORY_REGISTERED:
    case nixl_telemetry_event_type_t::AGENT_MEMORY_DEREGISTERED:
    case nixl_telemetry_event_type_t::AGENT_XFER_TIME:
    case nixl_telemetry_event_type_t::AGENT_XFER_POST_TIME:
    case nixl_telemetry_event_type_t::AGENT_TELEMETRY_EVENTS_DROPPED:
        return nullptr;
    }
    return nullptr;
}

/**
 * @brief Exporter-side Prometheus series descriptor for a telemetry event.
 *
 * The native Prometheus, multi-process Prometheus and DOCA/CollectX exporters
 * derive their series from this single mapping, so they emit the same metric
 * definitions. A null @c counterName, @c gaugeName, or @c histogramName means the
 * event has no cumulative counter, no last-operation gauge, or no distribution
 * histogram, respectively. Error events (@c AGENT_ERR_*) and any unmapped value
 * return an all-null descriptor.
 *
 * @param type Telemetry event type.
 * @return Counter/gauge series names and HELP strings for @p type.
 */
[[nodiscard]] constexpr nixlTelemetryMetricDescriptor
telemetryMetricDescriptor(const nixl_telemetry_event_type_t type) noexcept {
    switch (type) {
    case nixl_telemetry_event_type_t::AGENT_TX_BYTES:
        return {"agent_tx_bytes_total",
                "Number of bytes sent by the agent",
                "agent_tx_last_bytes",
                "Bytes sent by the last request",
                nullptr,
                nullptr};
    case nixl_telemetry_event_type_t::AGENT_RX_BYTES:
        return {"agent_rx_bytes_total",
                "Number of bytes received by the agent",
                "agent_rx_last_bytes",
                "Bytes received by the last request",
                nullptr,
                nullptr};
    case nixl_telemetry_event_type_t::AGENT_TX_REQUESTS_NUM:
        return {"agent_tx_requests_num_total",
                "Number of requests sent by the agent",
                nullptr,
                nullptr,
                nullptr,
                nullptr};
    case nixl_telemetry_event_type_t::AGENT_RX_REQUESTS_NUM:
        return {"agent_rx_requests_num_total",
                "Number of requests received by the agent",
                nullptr,
                nullptr,
                nullptr,
                nullptr};
    case nixl_telemetry_event_type_t::AGENT_MEMORY_REGISTERED:
        return {"agent_memory_registered_total",
                "Cumulative memory registered",
                "agent_memory_registered_last_bytes",
                "Memory registered by the last operation",
                nullptr,
                nullptr};
    case nixl_telemetry_event_type_t::AGENT_MEMORY_DEREGISTERED:
        return {"agent_memory_deregistered_total",
                "Cumulative memory deregistered",
                "agent_memory_deregistered_last_bytes",
                "Memory deregistered by the last operation",
                nullptr,
                nullptr};
    case nixl_telemetry_event_type_t::AGENT_XFER_TIME:
        return {"agent_xfer_time_total",
                "Cumulative sum of transfer time from start to completion",
                "agent_xfer_time",
                "Transfer time of the last request",
                "agent_xfer_time_us",
                "Distribution of transfer time from start to completion, in microseconds"};
    case nixl_telemetry_event_type_t::AGENT_XFER_POST_TIME:
        return {"agent_xfer_post_time_total",
                "Cumulative sum of time from start to posting to the back-end",
                "agent_xfer_post_time",
                "Post time of the last request",
                "agent_xfer_post_time_us",
                "Distribution of time from start to posting to the back-end, in microseconds"};
    case nixl_telemetry_event_type_t::AGENT_TELEMETRY_EVENTS_DROPPED:
        return {"agent_telemetry_events_dropped_total",
                "Cumulative telemetry events dropped at the producer-side staging queue",
                nullptr,
                nullptr,
                nullptr,
                nullptr};
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_POSTED:
    case nixl_telemetry_event_type_t::AGENT_ERR_INVALID_PARAM:
    case nixl_telemetry_event_type_t::AGENT_ERR_BACKEND:
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_FOUND:
    case nixl_telemetry_event_type_t::AGENT_ERR_MISMATCH:
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_ALLOWED:
    case nixl_telemetry_event_type_t::AGENT_ERR_REPOST_ACTIVE:
    case nixl_telemetry_event_type_t::AGENT_ERR_UNKNOWN:
    case nixl_telemetry_event_type_t::AGENT_ERR_NOT_SUPPORTED:
    case nixl_telemetry_event_type_t::AGENT_ERR_REMOTE_DISCONNECT:
    case nixl_telemetry_event_type_t::AGENT_ERR_CANCELED:
    case nixl_telemetry_event_type_t::AGENT_ERR_NO_TELEMETRY:
        break;
    }
    return {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
}
} // namespace nixlEnumStrings

/**
 * @struct nixlTelemetryEvent
 * @brief A structure to hold individual telemetry event data for cyclic buffer storage
 */
struct nixlTelemetryEvent {
    nixl_telemetry_event_type_t eventType_; // Detailed event type/identifier
    uint64_t value_; // Numeric value associated with the event

    nixlTelemetryEvent() noexcept = default;

    nixlTelemetryEvent(nixl_telemetry_event_type_t event_type, uint64_t value) noexcept
        : eventType_(event_type),
          value_(value) {}
};

#endif
