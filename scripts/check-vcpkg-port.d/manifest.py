# SPDX-License-Identifier: Apache-2.0
"""Checks ports/tierkv/vcpkg.json without the vcpkg tool: JSON, the fields a port needs, the
version against project(tierkv VERSION ...) in CMakeLists.txt (the one place it is set), and
that the portfile's options and the cuda feature name options CMakeLists.txt declares.
Usage: python3 manifest.py <repo root>. Prints one line on success; exits 1 on a problem."""
import json
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
port = root / "ports" / "tierkv"
problems = []

cmake = (root / "CMakeLists.txt").read_text()
m = re.search(r"project\(\s*tierkv\s+VERSION\s+([0-9]+\.[0-9]+\.[0-9]+)", cmake)
cmake_version = m.group(1) if m else None
if not cmake_version:
    problems.append("CMakeLists.txt: no project(tierkv VERSION x.y.z)")

try:
    manifest = json.loads((port / "vcpkg.json").read_text())
except ValueError as e:
    sys.exit(f"vcpkg.json: not JSON: {e}")
if not isinstance(manifest, dict):
    sys.exit("vcpkg.json: not a JSON object")

# The top-level fields of a vcpkg manifest (vcpkg.json reference); any other is a typo.
known = {"name", "version", "version-semver", "version-date", "version-string", "port-version",
         "description", "homepage", "documentation", "license", "maintainers", "summary",
         "supports", "dependencies", "default-features", "features", "builtin-baseline",
         "overrides", "vcpkg-configuration", "$schema"}
for key in manifest:
    if key not in known and not key.startswith("$"):
        problems.append(f"vcpkg.json: unknown field {key!r}")

if manifest.get("name") != port.name:
    problems.append(f"vcpkg.json: name {manifest.get('name')!r}, port folder {port.name!r}")
schemes = [k for k in ("version", "version-semver", "version-date", "version-string") if k in manifest]
if schemes != ["version"]:
    problems.append(f"vcpkg.json: expected exactly the 'version' field, found {schemes}")
elif manifest["version"] != cmake_version:
    problems.append(f"vcpkg.json: version {manifest['version']!r} but CMakeLists.txt's "
                    f"project() says {cmake_version!r}: change both together")
if not isinstance(manifest.get("description"), (str, list)) or not manifest.get("description"):
    problems.append("vcpkg.json: no description")
if manifest.get("license") != "Apache-2.0":
    problems.append(f"vcpkg.json: license {manifest.get('license')!r}, expected Apache-2.0")
if "Apache License" not in (root / "LICENSE").read_text()[:200]:
    problems.append("LICENSE: not the Apache License, but vcpkg.json says Apache-2.0")

deps = {d["name"]: d for d in manifest.get("dependencies", []) if isinstance(d, dict)}
for name in ("vcpkg-cmake", "vcpkg-cmake-config"):
    if deps.get(name, {}).get("host") is not True:
        problems.append(f"vcpkg.json: {name} must be a host dependency")

options = set(re.findall(r"option\(\s*(TIERKV_\w+)", cmake))
portfile = (port / "portfile.cmake").read_text()
features = manifest.get("features", {})
mapped = dict(re.findall(r"^\s+([a-z0-9-]+)\s+(TIERKV_\w+)\s*$", portfile, re.M))
for feature in features:
    if feature not in mapped:
        problems.append(f"portfile.cmake: feature {feature!r} is not in vcpkg_check_features")
    if not features[feature].get("description"):
        problems.append(f"vcpkg.json: feature {feature!r} has no description")
if mapped.get("cuda") != "TIERKV_CUDA":
    problems.append("portfile.cmake: the cuda feature must map to TIERKV_CUDA")
passed = set(re.findall(r"-D(TIERKV_\w+)=", portfile)) | set(mapped.values())
for opt in sorted(passed - options):
    problems.append(f"portfile.cmake: {opt} is not an option() of CMakeLists.txt")

if problems:
    print("\n".join(problems), file=sys.stderr)
    sys.exit(1)
print(f"vcpkg.json: fields ok, version {cmake_version} = CMakeLists.txt's project(); "
      f"options {', '.join(sorted(passed))} exist; features: {', '.join(features) or 'none'}")
