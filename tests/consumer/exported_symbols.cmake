# The `exported_symbols` test (cmake -P), shared builds only: every dynamic symbol a shared
# libflexattn defines belongs to its API, so fmt, the standard library's template instantiations
# and the engines' internals stay inside (cmake/flexattn.map, FLEXATTN_API). Allowed: names in
# namespace flexattn or flexattn::ir, members of their classes (PascalCase), the classes' type
# information and virtual tables, and the one function in flexattn::internal that the flexattn
# tool's conformance runner needs (src/engines/cpu_ref/cpu_ref.hpp). Variables: LIBRARY, NM.
cmake_minimum_required(VERSION 3.25)
set(allowed_internal "flexattn::internal::make_cpu_ref_engine")

execute_process(COMMAND ${NM} -D --defined-only -C ${LIBRARY}
                RESULT_VARIABLE status OUTPUT_VARIABLE listing ERROR_VARIABLE error)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "exported_symbols: ${NM} failed on ${LIBRARY}: ${error}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(count 0)
set(foreign "")
foreach(line IN LISTS lines)
  if(NOT line MATCHES "^[0-9a-f]+ [A-Za-z] (.+)$")
    continue()
  endif()
  set(symbol "${CMAKE_MATCH_1}")
  math(EXPR count "${count} + 1")
  string(REGEX REPLACE "^(typeinfo for |typeinfo name for |vtable for )" "" name "${symbol}")
  # The name up to its parameter list, without ABI tags: "flexattn::Graph::to_string[abi:cxx11]()
  # const" -> flexattn::Graph::to_string.
  string(REGEX REPLACE "\\[abi:[A-Za-z0-9_]+\\]" "" name "${name}")
  string(REGEX REPLACE "\\(.*$" "" name "${name}")
  if(name MATCHES "^flexattn::internal::")
    if(NOT name IN_LIST allowed_internal)
      list(APPEND foreign "${symbol}")
    endif()
  elseif(NOT name MATCHES "^flexattn::(ir::)?([A-Z][A-Za-z0-9]*::)*[~A-Za-z_][^:]*$")
    list(APPEND foreign "${symbol}")
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "exported_symbols: ${LIBRARY} exports nothing")
endif()
if(foreign)
  list(LENGTH foreign foreign_count)
  list(JOIN foreign "\n  " foreign_lines)
  message(FATAL_ERROR
    "exported_symbols: ${foreign_count} of ${count} exported symbols are not flexattn's API:\n"
    "  ${foreign_lines}")
endif()
message(STATUS "exported_symbols: ${count} symbols, all flexattn's API")
