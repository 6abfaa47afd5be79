"""Where data leaves the process: ClickHouse and Prometheus exporters."""
