"""The ``geofp8`` command's tools: fidelity analysis, reference training, benchmarks, demo,
bundled data and model loading. Built on the library; the library never imports them."""
