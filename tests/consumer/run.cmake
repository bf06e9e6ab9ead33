# The `consumer` test (cmake -P): a user's project (tests/consumer) built and run against an
# installed flexattn through find_package(flexattn) and through pkg-config (when pkg-config is
# there), and against flexattn's source tree through add_subdirectory.
#
# Variables: SOURCE_DIR, WORK_DIR, CXX_COMPILER, GENERATOR, CXX_FLAGS (the build's own, e.g. the
# sanitizers an instrumented library needs at link time), READELF, SHARED (whether the library is
# the shared one: the consumer must then load libflexattn.so, and must not otherwise), and either
#   BUILD_DIR: install this build into a fresh prefix under WORK_DIR; a static build also builds
#              the consumer as a subproject (the library alone, CPU engines; once is enough), or
#   PREFIX:    an installation already there (the .deb's: /usr, or where it was extracted).
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE output
                  ERROR_VARIABLE output)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "consumer: ${what} failed (${status}):\n${output}")
  endif()
  message(STATUS "consumer: ${what}: ok ${output}")
endfunction()

# Whether `executable` loads libflexattn.so, as SHARED says it must.
function(check_linkage what executable)
  execute_process(COMMAND ${READELF} -d ${executable} OUTPUT_VARIABLE dynamic
                  RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "consumer: ${READELF} -d ${executable} failed")
  endif()
  string(FIND "${dynamic}" "[libflexattn.so" at)
  if(SHARED AND at EQUAL -1)
    message(FATAL_ERROR "consumer: ${what} does not load libflexattn.so:\n${dynamic}")
  elseif(NOT SHARED AND NOT at EQUAL -1)
    message(FATAL_ERROR "consumer: ${what} loads libflexattn.so, but the library is static")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
if(DEFINED BUILD_DIR)
  set(prefix ${WORK_DIR}/prefix)
  run_step("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
else()
  set(prefix ${PREFIX})
endif()
foreach(required include/flexattn/flexattn.hpp include/flexattn/version.hpp
                 include/flexattn/export.hpp bin/flexattn)
  if(NOT EXISTS ${prefix}/${required})
    message(FATAL_ERROR "consumer: the install has no ${required}")
  endif()
endforeach()
file(GLOB_RECURSE internal_headers ${prefix}/include/*/engines/* ${prefix}/include/core/*
     ${prefix}/include/flexattn/conformance.hpp ${prefix}/include/flexattn/testing.hpp)
if(internal_headers)
  message(FATAL_ERROR "consumer: internal or test-only headers installed: ${internal_headers}")
endif()
file(GLOB shared_libraries ${prefix}/lib*/libflexattn.so*)
file(GLOB static_libraries ${prefix}/lib*/libflexattn.a)
if(SHARED AND (NOT shared_libraries OR static_libraries))
  message(FATAL_ERROR "consumer: a shared build installed '${shared_libraries}' '${static_libraries}'")
elseif(NOT SHARED AND (shared_libraries OR NOT static_libraries))
  message(FATAL_ERROR "consumer: a static build installed '${shared_libraries}' '${static_libraries}'")
endif()
# The installed tool runs from its prefix (a shared library found through its RPATH).
run_step("installed flexattn --version" ${prefix}/bin/flexattn --version)

run_step("configure with find_package" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer
         -B ${WORK_DIR}/build -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
         -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}")
run_step("build with find_package" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
check_linkage("the find_package build" ${WORK_DIR}/build/consumer)
run_step("run (find_package)" ${WORK_DIR}/build/consumer)

find_program(PKG_CONFIG pkg-config)
if(PKG_CONFIG)
  file(GLOB pc_file ${prefix}/lib*/pkgconfig/flexattn.pc)
  if(NOT pc_file)
    message(FATAL_ERROR "consumer: the install has no lib*/pkgconfig/flexattn.pc")
  endif()
  list(GET pc_file 0 pc_file)
  get_filename_component(pc_dir ${pc_file} DIRECTORY)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${pc_dir}
                          ${PKG_CONFIG} --cflags --libs --static flexattn
                  RESULT_VARIABLE status OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "consumer: pkg-config does not know flexattn")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  separate_arguments(build_flags UNIX_COMMAND "${CXX_FLAGS}")
  run_step("build with pkg-config" ${CXX_COMPILER} -O1 ${build_flags}
           ${SOURCE_DIR}/tests/consumer/consumer.cpp
           -o ${WORK_DIR}/consumer_pkgconfig ${flags})
  check_linkage("the pkg-config build" ${WORK_DIR}/consumer_pkgconfig)
  # pkg-config gives no run-time path: a shared library is found through LD_LIBRARY_PATH.
  get_filename_component(lib_dir ${pc_dir} DIRECTORY)
  run_step("run (pkg-config)" ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${lib_dir}
           ${WORK_DIR}/consumer_pkgconfig)
endif()

if(DEFINED BUILD_DIR AND NOT SHARED)
  # The library is compiled once more here (CPU engines only); ccache, when there, shares
  # objects. As a subproject flexattn's tests, tools, benchmarks and examples default to off.
  find_program(CCACHE ccache)
  set(launcher "")
  if(CCACHE)
    set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE})
  endif()
  run_step("configure as a subproject" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer/subproject
           -B ${WORK_DIR}/subproject -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
           -DFLEXATTN_SOURCE_DIR=${SOURCE_DIR} -DCMAKE_BUILD_TYPE=Release
           "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" -DFLEXATTN_ENABLE_CUDA=OFF ${launcher})
  run_step("build as a subproject" ${CMAKE_COMMAND} --build ${WORK_DIR}/subproject
           --target consumer)
  check_linkage("the subproject build" ${WORK_DIR}/subproject/consumer)
  run_step("run (subproject)" ${WORK_DIR}/subproject/consumer)
endif()
