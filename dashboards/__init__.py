"""Grafana dashboards as code, provisioning files and alert rules."""
