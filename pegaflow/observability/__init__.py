"""What operators see: the HTTP endpoint, hot-path metrics, OpenTelemetry export."""
