"""Geometry: input statistics (:mod:`.statistics`), the maps to communication coordinates
(:mod:`.transforms`), the one transform factory (:mod:`.factory`) and where factors come
from (:mod:`.sources`)."""
