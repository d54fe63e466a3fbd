"""Test cases' results as JUnit XML, the report CI systems read (GitLab, Jenkins, GitHub
actions that annotate): one ``testsuite`` per cases file, one ``testcase`` per case, a
``failure`` holding its diff."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from gateway.policytest.case_run import CaseResult


def junit_xml(suite: str, policy: str, results: list[CaseResult]) -> str:
    failed = [r for r in results if not r.passed]
    testsuites = ET.Element(
        "testsuites", tests=str(len(results)), failures=str(len(failed)), errors="0"
    )
    testsuite = ET.SubElement(
        testsuites,
        "testsuite",
        name=suite,
        tests=str(len(results)),
        failures=str(len(failed)),
        errors="0",
        skipped="0",
        time="0",
    )
    ET.SubElement(ET.SubElement(testsuite, "properties"), "property", name="policy", value=policy)
    for result in results:
        testcase = ET.SubElement(testsuite, "testcase", classname=suite, name=result.name, time="0")
        if not result.passed:
            diff = result.diff()
            first = next(
                (line for line in diff if line.startswith("+") and not line.startswith("+++")), ""
            )
            failure = ET.SubElement(
                testcase,
                "failure",
                message=f"expected and actual differ: {first[1:]}",
                type="mismatch",
            )
            failure.text = "\n".join(diff) + "\n"
    ET.indent(testsuites)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        + ET.tostring(testsuites, encoding="unicode")
        + "\n"
    )
