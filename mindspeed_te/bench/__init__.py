"""The benchmark program (`python -m mindspeed_te.bench`): every row a ratio to a baseline doing the same work,
measured in the same run, against the target the issues set (`report.TARGETS`). One module per group."""
