"""What a run writes beside the perturbed arrays, and what it leaves out; shared by the
formats that carry more than arrays (hdf5, zarr_store, safetensors_file, npz, images).

The rule: nothing private leaves raw unless the user names it. What is not perturbed
is, in each format,
- structural metadata that readers need to make sense of the perturbed values
  (STRUCTURAL: CF conventions, units, dimension names and scales, coordinates,
  OME-Zarr image structure, a model file's `format`): written as it is, not listed;
- coordinates (dimension scales, the variables a CF attribute names as coordinates)
  and CF grid mappings, when they hold numbers: public grids such as lat, lon and
  time, copied raw and listed in the manifest's `unperturbed` with the reason
  "coordinate" (or "grid mapping"); but a variable that runs along the record axis of a
  perturbed array (the record dimension among its dimensions) and is not another
  dimension's own coordinate (the record dimension's own coordinate, such as subject(subject)
  or time(time) of each record; CF's auxiliary coordinates, named by a `coordinates`
  attribute, such as a trajectory's lat(trajectory, obs); their bounds and cell measures),
  or is a feature's identifier (a cf_role), holds a value per record, not a grid: it is left out and listed
  in `dropped` (RECORD_COORDINATE), and the attributes naming it name the rest;
- anything the user names with --keep (a dataset or array, an attribute as
  PATH@NAME, a file): copied raw and listed in `unperturbed` ("kept by --keep");
- everything else (datasets that are not perturbed, strings, tables, free-text and
  statistical attributes, other files): left out of the output and listed in the
  manifest's `dropped`, each with its kind and the reason.

Names are those the manifest uses: a dataset's path, an attribute as PATH@NAME (the
file's own as /@NAME, or @NAME in a model file). --keep takes the same names or
globs of them, with or without the leading "/".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tldp_cli.errors import NotHeld
from tldp_cli.formats.tensor_files import matching

KEPT = "kept by --keep"
COORDINATE = "coordinate"
GRID_MAPPING = "grid mapping"  # a CF grid mapping variable: the projection the data lies on
# A variable along the record axis that CF names as a coordinate, bounds or cell measure
# (xarray's elev(station), an ID subject_id(record), a trajectory's lat(trajectory, obs)), or a
# feature's identifier (cf_role): a value per record, not a grid, so it is left out unless
# --keep names it (cf.record_coordinates).
RECORD_COORDINATE = "record coordinate"
RECORD_COORDINATE_REASON = ("a coordinate along the record axis (the record dimension's own coordinate, an "
                            "auxiliary coordinate, bounds or cell measure, or a feature's cf_role identifier): "
                            "a value per record, not a grid (--keep copies it)")
# Attributes readers need to interpret the values, by name, in every format.
CF_ATTRIBUTES = (
    "Conventions", "units", "standard_name", "long_name", "axis", "calendar", "positive", "coordinates",
    "bounds", "climatology", "cell_measures", "cell_methods", "grid_mapping", "formula_terms",
    "ancillary_variables", "flag_values", "flag_masks", "flag_meanings", "_FillValue", "missing_value",
    "scale_factor", "add_offset", "_Unsigned", "valid_range", "valid_min", "valid_max", "compress",
    "featureType", "cf_role", "instance_dimension", "sample_dimension", "units_metadata", "leap_month",
    "leap_year", "month_lengths", "_Encoding", "dtype")
# The attributes of a CF grid mapping variable (CF Appendix F) and GDAL's.
GRID_MAPPING_ATTRIBUTES = (
    "grid_mapping_name", "semi_major_axis", "semi_minor_axis", "inverse_flattening", "earth_radius",
    "longitude_of_prime_meridian", "prime_meridian_name", "reference_ellipsoid_name",
    "horizontal_datum_name", "geographic_crs_name", "projected_crs_name", "towgs84", "crs_wkt",
    "standard_parallel", "longitude_of_central_meridian", "latitude_of_projection_origin",
    "longitude_of_projection_origin", "false_easting", "false_northing",
    "scale_factor_at_central_meridian", "scale_factor_at_projection_origin",
    "straight_vertical_longitude_from_pole", "grid_north_pole_latitude", "grid_north_pole_longitude",
    "north_pole_grid_longitude", "perspective_point_height", "sweep_angle_axis", "fixed_angle_axis",
    "azimuth_of_central_line", "spatial_ref", "GeoTransform")
# HDF5 dimension scales and netCDF-4's own bookkeeping.
HDF5_ATTRIBUTES = ("CLASS", "NAME", "DIMENSION_LIST", "REFERENCE_LIST", "DIMENSION_LABELS",
                   "_Netcdf4Dimid", "_Netcdf4Coordinates", "_NCProperties", "_nc3_strict")
# xarray's dimension names (Zarr 2) and the OME-Zarr (NGFF) image structure; the values
# computed from the raw data inside it are replaced or dropped, and the names, ids and
# dates inside it left out (unless --keep), by the Zarr format (zarr_ome.py).
ZARR_ATTRIBUTES = ("_ARRAY_DIMENSIONS", "multiscales", "omero", "ome", "image-label", "labels",
                   "bioformats2raw.layout", "plate", "well")
STRUCTURAL = frozenset(CF_ATTRIBUTES + GRID_MAPPING_ATTRIBUTES + HDF5_ATTRIBUTES + ZARR_ATTRIBUTES)

# Images' ICC colour profiles (Pillow's info["icc_profile"]), by the name --keep and the
# manifest give them: Pillow's key (a table's: COLUMN icc_profile).
ICC_PROFILE = "icc_profile"
# Images' alpha channels (transparency), by the name --keep and the manifest give them (a
# table's: COLUMN.alpha). Not perturbed: a cut-out's alpha is its subject's silhouette.
ALPHA = "alpha"
ALPHA_KIND = "alpha channel"

ATTRIBUTE_REASON = "metadata tldp does not perturb, not among the structural attributes readers need"


def not_numbers(dtype) -> str:
    """What an array that is not numbers holds, as a phrase ("holds strings")."""
    if dtype.kind in "USTO":
        return "strings" if dtype.kind != "O" else "Python objects"
    return "a compound (table) type" if dtype.names else f"{dtype} values"


def grid_mappings(text: str | None) -> list[str]:
    """The variables a CF grid_mapping attribute names: "crs", or "crs: lat lon" (CF 1.7)."""
    words = (text or "").split()
    if any(word.endswith(":") for word in words):
        return [word[:-1] for word in words if word.endswith(":")]
    return words


def attribute_name(owner: str, key: str) -> str:
    """An attribute's name in the manifest and for --keep: PATH@NAME."""
    return f"{owner}@{key}"


@dataclass
class Leftovers:
    """The manifest's `unperturbed` (written raw, each with its reason) and `dropped` (left
    out, each with its kind and reason) of one run, and the --keep patterns deciding them."""

    keep: list[str] = field(default_factory=list)
    unperturbed: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    _used: set[str] = field(default_factory=set)  # the --keep patterns that matched a name

    def kept(self, name: str) -> bool:
        """Whether --keep names it."""
        pattern = matching(name, self.keep)
        if pattern is None:
            return False
        self._used.add(pattern)
        return True

    def copied(self, name: str, kind: str, reason: str, **fields: Any) -> None:
        self.unperturbed.append({"name": name, "kind": kind, **fields, "reason": reason})

    def drop(self, name: str, kind: str, reason: str) -> None:
        self.dropped.append({"name": name, "kind": kind, "reason": reason})

    def attribute(self, owner: str, key: str, structural: Iterable[str] = STRUCTURAL,
                  kind: str = "attribute", reason: str = ATTRIBUTE_REASON) -> bool:
        """Whether attribute `key` of `owner` is written: a structural one silently, one --keep
        names listed as unperturbed; any other is listed as dropped."""
        name = attribute_name(owner, key)
        if self.kept(name):  # first: --keep patterns that name structural ones count as used
            if key not in structural:
                self.copied(name, kind, KEPT)
            return True
        if key in structural:
            return True
        self.drop(name, kind, reason)
        return False

    def icc_profiles(self, count: int, what: str = "image", name: str = ICC_PROFILE) -> bool:
        """Whether the ICC colour profiles `count` images carry are written: only where --keep
        names them (a profile can hold free text: its description and copyright tags, and
        a camera's or scanner's own calibration); either way listed."""
        if not count:
            return False
        images = f"{count} {what}" + ("s" if count != 1 else "")
        if self.kept(name):
            self.copied(name, "colour profile", f"{KEPT}; copied raw from {images}")
            return True
        self.drop(name, "colour profile", f"the ICC colour profiles of {images}: they can hold free text (the "
                                          f"profile's description and copyright tags); --keep {name} copies them")
        return False

    def alpha_channels(self, count: int, what: str = "image", name: str = ALPHA, where: str = "") -> bool:
        """Whether the alpha channels `count` images have are written (copied raw: tldp perturbs
        the colour channels only): only where --keep names them; either way listed. Left out,
        each image is written without it (RGBA as RGB, LA as L)."""
        if not count:
            return False
        images = f"{count} {what}" + ("s" if count != 1 else "") + where
        if self.kept(name):
            self.copied(name, ALPHA_KIND, f"{KEPT}; not perturbed, copied raw from {images} (transparency can "
                                          "outline the subject)")
            return True
        self.drop(name, ALPHA_KIND, f"the alpha channels of {images}: not perturbed, and transparency can outline "
                                    f"the subject (a cut-out's silhouette); written without it (RGBA as RGB, LA as "
                                    f"L); --keep {name} copies them raw")
        return False

    def considered(self, names: Iterable[str]) -> None:
        """Names --keep may match that the run does not decide here (the perturbed arrays)."""
        for name in names:
            self.kept(name)

    def check(self, path: Path) -> None:
        """Refuses a --keep pattern that matches nothing in the input (a typo would drop
        what the user meant to keep)."""
        unused = [p for p in self.keep if p not in self._used]
        if unused:
            raise NotHeld(f"{path}: --keep {unused[0]} matches no dataset, attribute, column or file of the input "
                          "(give a path, PATH@ATTRIBUTE, or a glob of them)", "keep", unused)

    def manifest_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.unperturbed:
            extra["unperturbed"] = self.unperturbed
        if self.dropped:
            extra["dropped"] = self.dropped
        return extra
